import torch, math
torch.set_num_threads(1)
from transformers import Qwen3OmniMoeForConditionalGeneration
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained("/tmp/omni-research/tiny-omni").eval()
c2w = m.code2wav
torch.manual_seed(1)
for F in [1, 2, 3, 10, 39, 50, 300, 301, 330]:
    codes = torch.randint(0, 2048, (1, 16, F))
    with torch.no_grad():
        w = c2w(codes); wc = c2w.chunked_decode(codes, chunk_size=300, left_context_size=25)
    print(F, "forward", w.shape[-1], "chunked", wc.shape[-1], "F*1920", F*1920, "diff", F*1920 - wc.shape[-1], "std", float(w.std()))
# where does the magnitude die
codes = torch.randint(0, 2048, (1, 16, 39))
with torch.no_grad():
    h = c2w.code_embedding(codes + c2w.code_offset).mean(1); print("emb std", float(h.std()))
    h = c2w.pre_transformer(inputs_embeds=h).last_hidden_state; print("pre_transformer std", float(h.std()))
    h = h.permute(0, 2, 1)
    for blocks in c2w.upsample:
        for b in blocks: h = b(h)
    print("upsample std", float(h.std()), h.shape)
    for i, b in enumerate(c2w.decoder):
        h = b(h); print("decoder", i, type(b).__name__, tuple(h.shape), "std %.3e" % float(h.std()))
