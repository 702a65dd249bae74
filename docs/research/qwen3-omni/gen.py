import os, sys, time, json, hashlib
import torch
torch.set_num_threads(1)
from transformers import Qwen3OmniMoeForConditionalGeneration
MODEL = os.environ.get("MODEL", "/tmp/omni-research/tiny-omni")
T_MAX = int(os.environ.get("T_MAX", "8")); K_MAX = int(os.environ.get("K_MAX", "40"))
MIN_FRAMES = os.environ.get("MIN_FRAMES"); EOS_BIAS = os.environ.get("EOS_BIAS")
GREEDY_CP = os.environ.get("GREEDY_CP") == "1"; TALKER_GREEDY = os.environ.get("TALKER_GREEDY") == "1"
t0 = time.time()
model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
print("load_s", round(time.time() - t0, 2))
# <|im_start|>user\nHello, world<|im_end|>\n<|im_start|>assistant\n  (Qwen2 ids)
ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 151645, 198, 151644, 77091, 198]])
cap = {"cp_calls": 0, "c2w_in": [], "c2w_out": []}
cp = model.talker.code_predictor
orig_cp_generate = cp.generate
def cp_generate(*a, **k):
    cap["cp_calls"] += 1
    cap["cp_kwargs"] = {x: k.get(x) for x in ("do_sample", "top_k", "top_p", "max_new_tokens")}
    if GREEDY_CP:
        k.update(do_sample=False, top_k=None, top_p=None)
    return orig_cp_generate(*a, **k)
cp.generate = cp_generate
orig_c2w_forward = model.code2wav.forward
def c2w_forward(codes):
    cap["c2w_in"].append(codes.clone()); out = orig_c2w_forward(codes); cap["c2w_out"].append(out.clone()); return out
model.code2wav.forward = c2w_forward
kw = dict(input_ids=ids, return_audio=True, speaker="Ethan", thinker_max_new_tokens=T_MAX, talker_max_new_tokens=K_MAX)
if TALKER_GREEDY: kw["talker_do_sample"] = False
if MIN_FRAMES: kw["talker_min_new_tokens"] = int(MIN_FRAMES)
if EOS_BIAS: kw["talker_sequence_bias"] = {(2150,): float(EOS_BIAS)}
def run():
    torch.manual_seed(int(os.environ.get("SEED", "0")))
    t = time.time()
    thinker_result, wav = model.generate(**kw)
    return thinker_result, wav, time.time() - t
for r in range(int(os.environ.get("RUNS", "2"))):
    cap["c2w_in"].clear(); cap["c2w_out"].clear(); cap["cp_calls"] = 0
    tr, wav, dt = run()
    codes = cap["c2w_in"][0]
    print(f"run{r}: gen_s={dt:.2f} thinker_seq={tuple(tr.sequences.shape)} new_text={tr.sequences[0, ids.shape[1]:].tolist()}")
    print(f"  cp_generate calls={cap['cp_calls']} kwargs_seen={cap['cp_kwargs']}")
    print(f"  code2wav input codes shape={tuple(codes.shape)} (batch,16,frames) ; wav shape={tuple(wav.shape)} samples/frame={wav.shape[-1]/codes.shape[-1]}")
    print(f"  codebook0={codes[0,0].tolist()}")
    print(f"  frame0 all16={codes[0,:,0].tolist()}")
    print(f"  max code={int(codes.max())} min={int(codes.min())}  wav absmax={float(wav.abs().max()):.4f}")
    print("  sha codes", hashlib.sha256(codes.numpy().tobytes()).hexdigest()[:16], "sha wav", hashlib.sha256(wav.numpy().tobytes()).hexdigest()[:16])
