"""Reference run: tokenizer chat template -> generate(return_audio) with capture of all 16 codebooks and code2wav I/O."""
import time, hashlib, json
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration
D = "/tmp/omni-research/tiny-omni"
tok = AutoTokenizer.from_pretrained(D)
model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(D, dtype=torch.float32).eval()
cap = {}
# 1) talker.generate -> full talker_result (sequences = codebook-0 tokens incl. EOS; hidden_states[i][-1] = 16 codes per frame)
orig_talker_generate = model.talker.generate
def talker_generate(*a, **k):
    cap["talker_kwargs"] = {x: (v if not torch.is_tensor(v) else tuple(v.shape)) for x, v in k.items() if x not in ("trailing_text_hidden", "tts_pad_embed", "suppress_tokens")}
    r = orig_talker_generate(*a, **k); cap["talker_result"] = r; return r
model.talker.generate = talker_generate
# 2) code predictor: force greedy for codebooks 1..15 (HF hard-codes do_sample=True, top_k=50, top_p=0.8)
orig_cp_generate = model.talker.code_predictor.generate
def cp_generate(*a, **k):
    k.update(do_sample=False, top_k=None, top_p=None); return orig_cp_generate(*a, **k)
model.talker.code_predictor.generate = cp_generate
# 3) code2wav I/O
orig_cd = model.code2wav.chunked_decode
def chunked_decode(codes, **k):
    cap["codes"] = codes.clone(); w = orig_cd(codes, **k); cap["wav"] = w.clone(); return w
model.code2wav.chunked_decode = chunked_decode
msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello, world"}]}]
enc = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_tensors="pt", return_dict=True)
torch.manual_seed(0); t = time.time()
thinker_result, wav = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], return_audio=True,
    speaker="Ethan", thinker_max_new_tokens=8, thinker_do_sample=False,
    talker_do_sample=False, talker_max_new_tokens=64, talker_min_new_tokens=30, talker_sequence_bias={(2150,): 100.0})
dt = time.time() - t
tr = cap["talker_result"]; codes = cap["codes"]
print("gen_s %.2f" % dt)
print("talker_kwargs", cap["talker_kwargs"])
print("thinker sequences", tuple(thinker_result.sequences.shape), "talker sequences", tuple(tr.sequences.shape), "last talker token", int(tr.sequences[0, -1]))
print("codes (B,16,F)", tuple(codes.shape), "wav", tuple(wav.shape), "expected 1920*F-555 =", 1920 * codes.shape[-1] - 555)
print("codebook0 == talker sequences[:-1]:", bool(torch.equal(codes[0, 0], tr.sequences[0, :-1])))
per_frame = torch.cat([h[-1] for h in tr.hidden_states if h[-1] is not None], 0)  # (F,16)
print("per-frame residual codes from hidden_states (F,16):", tuple(per_frame.shape), "== codes.T:", bool(torch.equal(per_frame, codes[0].T)))
print("wav std %.4f absmax %.4f" % (wav.std(), wav.abs().max()))
print("sha codes", hashlib.sha256(codes.numpy().tobytes()).hexdigest()[:16], "sha wav", hashlib.sha256(wav.numpy().tobytes()).hexdigest()[:16])
