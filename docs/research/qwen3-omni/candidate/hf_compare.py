"""HF reference (transformers 4.57.3, fp32, greedy talker + greedy code predictor) on the same chat prompt as
client.py; prints thinker ids, talker ids and codes to compare with the vLLM dumps (run7/run11)."""
import json, torch
torch.set_num_threads(1)
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration
D = "/tmp/omni-cand/tiny-omni"
tok = AutoTokenizer.from_pretrained(D)
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained(D, torch_dtype=torch.float32).eval()
ids = tok.apply_chat_template([{"role": "user", "content": "Hello, world."}], add_generation_prompt=True, return_tensors="pt")
print("prompt", ids.shape[1], ids[0].tolist())
cp = m.talker.code_predictor; g = cp.generate
cp.generate = lambda *a, **k: g(*a, **{**k, "do_sample": False, "top_k": None, "top_p": None})
tg = m.talker.generate; keep = {}
def tgen(*a, **k):
    r = tg(*a, **k); keep["r"] = r; return r
m.talker.generate = tgen
torch.manual_seed(0)
th, wav = m.generate(ids, speaker="Ethan", thinker_max_new_tokens=8, thinker_do_sample=False, talker_do_sample=False,
                     talker_max_new_tokens=20, talker_repetition_penalty=1.0, return_audio=True)
print("thinker new ids", th.sequences[0, ids.shape[1]:].tolist())
r = keep["r"]; seq = r.sequences[0].tolist(); print("talker seq", len(seq), seq[:8])
codes = torch.stack([h[-1] for h in r.hidden_states if h[-1] is not None], 1) if False else None
frames = [h[-1][0].tolist() for h in r.hidden_states[1:]] if isinstance(r.hidden_states[1][-1], torch.Tensor) else None
print("frames", len(frames) if frames else None); 
if frames: print("frame0", frames[0]); print("frame1", frames[1])
print("wav", tuple(wav.shape))
json.dump({"thinker": th.sequences[0, ids.shape[1]:].tolist(), "talker": seq, "frames": frames}, open("/tmp/omni-cand/hf_ref.json", "w"))
