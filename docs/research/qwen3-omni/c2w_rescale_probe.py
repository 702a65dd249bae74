import torch, math
torch.set_num_threads(1)
from torch import nn
from transformers import Qwen3OmniMoeForConditionalGeneration
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained("/tmp/omni-research/tiny-omni").eval()
c2w = m.code2wav
def rescale(c2w, gain=1.0, last_gain=0.05):
    g = torch.Generator().manual_seed(1234)
    convs = [mod for mod in list(c2w.upsample.modules()) + list(c2w.decoder.modules()) if isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d))]
    for i, mod in enumerate(convs):
        k = mod.kernel_size[0]
        if isinstance(mod, nn.ConvTranspose1d):
            fan = mod.in_channels * k / mod.stride[0]
        else:
            fan = mod.in_channels // mod.groups * k
        is_res = any(mod is x for ru in c2w.decoder.modules() if type(ru).__name__.endswith("ResidualUnit") for x in ru.modules())
        std = (last_gain if i == len(convs) - 1 else (0.5 if is_res else gain)) / math.sqrt(fan)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * std)
rescale(c2w)
torch.manual_seed(1)
codes = torch.randint(0, 2048, (1, 16, 39))
with torch.no_grad():
    h = c2w.code_embedding(codes + c2w.code_offset).mean(1)
    h = c2w.pre_transformer(inputs_embeds=h).last_hidden_state.permute(0, 2, 1)
    print("pre std", float(h.std()))
    for blocks in c2w.upsample:
        for b in blocks: h = b(h)
    print("upsample std", float(h.std()))
    for i, b in enumerate(c2w.decoder):
        h = b(h); print("decoder", i, tuple(h.shape), "std %.3e" % float(h.std()))
    w = c2w(codes); print("final clamp std", float(w.std()), "frac clipped", float((w.abs() >= 1).float().mean()))
    w2 = c2w(torch.randint(0, 2048, (1, 16, 39))); print("other codes std", float(w2.std()), "corr", float(torch.corrcoef(torch.stack([w.flatten(), w2.flatten()]))[0,1]))
