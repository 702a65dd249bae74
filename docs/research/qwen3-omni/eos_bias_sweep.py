import torch, time
torch.set_num_threads(1)
from transformers import Qwen3OmniMoeForConditionalGeneration
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained("/tmp/omni-research/tiny-omni").eval()
ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 151645, 198, 151644, 77091, 198]])
frames = {}
orig = m.code2wav.chunked_decode
def cd(codes, **k):
    frames["n"] = codes.shape[-1]; return orig(codes, **k)
m.code2wav.chunked_decode = cd
# also inspect raw eos logit scale at the talker head
for bias in [0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0]:
    res = []
    for seed in range(4):
        torch.manual_seed(seed); t = time.time()
        kw = dict(input_ids=ids, return_audio=True, speaker="Ethan", thinker_max_new_tokens=4, talker_max_new_tokens=120)
        if bias: kw["talker_sequence_bias"] = {(2150,): bias}
        try:
            _, wav = m.generate(**kw); res.append(frames["n"])
        except RuntimeError as e:
            res.append("ERR:" + str(e)[:45])
    print(f"bias={bias}: frames per seed 0..3 = {res} (cap 119)")
w = m.talker.codec_head.weight
print("codec_head row norms: eos(2150) %.3f, mean over 0..2047 %.3f" % (w[2150].norm(), w[:2048].norm(dim=1).mean()))

# logit scale of the talker head
cap = {}
h = m.talker.codec_head.register_forward_hook(lambda mod, i, o: cap.setdefault("l", []).append(o[0, -1].detach()))
torch.manual_seed(0); m.generate(input_ids=ids, return_audio=True, speaker="Ethan", thinker_max_new_tokens=4, talker_max_new_tokens=20)
L = torch.stack(cap["l"])[:, :2048]; e = torch.stack(cap["l"])[:, 2150]
print("talker logits over codes 0..2047: std %.3f, max-per-step mean %.3f; eos logit mean %.3f std %.3f" % (L.std(), L.max(1).values.mean(), e.mean(), e.std()))
