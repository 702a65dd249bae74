"""Does a "massive activation" hazard make vLLM-Omni #2274's arithmetic visible on the CPU (issue 58)?

    .venv-reference/bin/python benchmarks/bench_hazard_numerics.py [--store /tmp/hz] [--frames 60] [--batch 8]
                                                                   [--ratios 100,1000,10000] [--qk-scale 1,4]

Builds the tiny base checkpoint plain and with `hazard` (runners/reference/tiny_checkpoint.py), samples
code streams from each with float32 qwen-tts (a few short texts, x-vector prompts, sampling on), then
teacher-forces the code predictor (cb1-15: the 15 steps conditioned on the true earlier codebooks, as one
causal forward of 16 positions, which is what vLLM-Omni's re-prefill computes) and the talker (cb0) in
  f32      float32: the reference;
  bf16     bf16 as HF/qwen-tts and the fixed release compute it (RMSNorm variance and RoPE angles in f32);
  mutant   #2274 (cases/bugs/cp-numerics-2274/revert.patch): variance and cos/sin angles in bf16;
  mut_var / mut_rope   the two halves of the mutant alone.
The inputs of each stage (the talker's hidden for the code predictor) come from the float32 run, so each
stage's numerics are measured alone. Per numerics: tokens off the float32 top-1, mean |delta logprob| of
the float32 top-1 token, mean KL(f32 || x), and for mutant vs bf16 a two-proportion p-value and the exact
McNemar split. `--ratios` re-plants the hazard in memory on the plain build at other HAZARD_RATIOs;
`--qk-scale` multiplies the code predictor's q_norm/k_norm weights (sharper attention, as trained models
have) to test the RoPE-angle mechanism. Prints one JSON object.
"""

import argparse
import contextlib
import copy
import json
import math
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Please call Stella and ask her to bring these things.", "It is a sunny morning in the park.",
         "Numbers like forty two are hard to say.", "Where did you put the keys?",
         "A short sentence for a tiny model.", "Good night and sleep well."]
EOS = 2150


def _torch():
    from runners.reference.environment import import_qwen_tts

    import_qwen_tts()
    import torch

    torch.set_num_threads(1)
    return torch


# -- the three numerics -------------------------------------------------------------------------------

def _rms_bf16_variance(self, hidden_states):
    """The mutant's _RMSNorm.forward_native: no cast to float32 before the variance."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states


def _rope_bf16_angles(self, x, position_ids):
    """The mutant's _RotaryEmbedding.forward_native: angles (inv_freq @ positions) and cos/sin in x's dtype."""
    inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos = position_ids[:, None, :].float()
    freqs = (inv.to(x.dtype) @ pos.to(x.dtype)).transpose(1, 2)
    emb = __import__("torch").cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _talker_rope_bf16_angles(self, x, position_ids):
    """The same mistake in the talker's 3-section (MRoPE) rotary embedding."""
    inv = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
    pos = position_ids[:, :, None, :].float()
    freqs = (inv.to(x.dtype) @ pos.to(x.dtype)).transpose(2, 3)
    emb = __import__("torch").cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def numerics_copy(module, kind: str):
    """`module` in float32 (f32), or a bf16 copy with the HF numerics (bf16) or the #2274 ones."""
    import torch

    if kind == "f32":
        return module
    m = copy.deepcopy(module).to(torch.bfloat16)
    for mod in m.modules():
        name = type(mod).__name__
        if kind in ("mutant", "mut_var") and name.endswith("RMSNorm"):
            mod.forward = types.MethodType(_rms_bf16_variance, mod)
        if kind in ("mutant", "mut_rope"):
            if name == "Qwen3TTSRotaryEmbedding":
                mod.forward = types.MethodType(_rope_bf16_angles, mod)
            elif name == "Qwen3TTSTalkerRotaryEmbedding":
                mod.forward = types.MethodType(_talker_rope_bf16_angles, mod)
    return m


KINDS = ["f32", "bf16", "mutant", "mut_var", "mut_rope"]


# -- streams --------------------------------------------------------------------------------------------

def sample_streams(tts, frames: int, batch: int, seed: int):
    """Float32 sampled generation; records each code-predictor call's input (talker hidden, cb0 embedding)
    and its 15 codes, and every talker forward's inputs (to teacher-force the talker afterwards)."""
    torch = _torch()
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    talker = tts.model.talker
    cp = talker.code_predictor
    cp_calls, talker_calls, codes = [], [], {}
    inner = cp.generate

    def cp_generate(*a, **kw):
        out = inner(*a, **kw)
        cp_calls.append((kw["inputs_embeds"].detach().clone(), out.sequences.detach().clone()))
        return out

    def talker_pre(mod, args, kwargs):
        talker_calls.append({k: (kwargs[k].detach().clone() if kwargs.get(k) is not None else None)
                             for k in ("inputs_embeds", "position_ids", "attention_mask")})

    cp.generate = cp_generate
    hook = talker.model.register_forward_pre_hook(talker_pre, with_kwargs=True)
    inner_gen = tts.model.generate

    def gen(*a, **kw):
        c, h = inner_gen(*a, **kw)
        codes["list"] = [x.detach().clone() for x in c]
        return c, h

    tts.model.generate = gen
    try:
        g = torch.Generator().manual_seed(seed)
        hidden = talker.config.hidden_size
        items = [VoiceClonePromptItem(ref_code=None, ref_spk_embedding=torch.randn(hidden, generator=g),
                                      x_vector_only_mode=True, icl_mode=False) for _ in range(batch)]
        torch.manual_seed(seed)
        tts.generate_voice_clone(text=TEXTS[:batch], language=["English"] * batch, voice_clone_prompt=items,
                                 do_sample=True, subtalker_dosample=True, max_new_tokens=frames)
    finally:
        cp.generate = inner
        hook.remove()
        del tts.model.generate
    return cp_calls, talker_calls, codes["list"]


def stream_stats(code_list):
    import numpy as np

    lens = [len(c) for c in code_list]
    allc = np.concatenate([c.numpy() for c in code_list])
    return {"frames": int(sum(lens)), "lengths": lens,
            "distinct_cb0_share": round(len(set(allc[:, 0].tolist())) / len(allc), 3),
            "distinct_frames_share": round(len({tuple(r) for r in allc.tolist()}) / len(allc), 3),
            "max_run_cb0": int(max(max((np.diff(np.flatnonzero(np.diff(np.r_[-1, c[:, 0].numpy(), -1]) != 0))
                                        for c in code_list), key=len).max(), 1))}


# -- teacher forcing --------------------------------------------------------------------------------------

def cp_inputs(cp, cp_calls):
    """[frames, 16, talker hidden]: talker hidden, cb0 embedding, cb1..cb14 embeddings (the true codes)."""
    torch = _torch()
    rows = []
    for emb2, seq in cp_calls:
        parts = [emb2] + [cp.model.codec_embedding[i](seq[:, i:i + 1]) for i in range(14)]
        rows.append(torch.cat(parts, 1))
    return torch.cat(rows, 0)


def cp_logits(cp, x, kind):
    torch = _torch()
    m = numerics_copy(cp, kind)
    dtype = next(m.parameters()).dtype
    with torch.no_grad():
        out = m.forward_finetune(inputs_embeds=x.to(dtype)).logits
    return out.float().reshape(-1, out.shape[-1])


def talker_logits(talker, calls, kind):
    """Teacher-forced talker: every recorded forward's input concatenated, one causal forward; the logits
    where each recorded call ended (the cb0 it predicted), restricted to the 2048 codes and EOS."""
    torch = _torch()
    m_model = numerics_copy(talker.model, kind)
    head = numerics_copy(talker.codec_head, kind)
    dtype = next(m_model.parameters()).dtype
    x = torch.cat([c["inputs_embeds"] for c in calls], 1).to(dtype)
    pos = torch.cat([c["position_ids"] for c in calls], -1)
    mask = calls[-1]["attention_mask"]
    ends = torch.tensor([c["inputs_embeds"].shape[1] for c in calls]).cumsum(0) - 1
    with torch.no_grad():
        h = m_model(inputs_embeds=x, position_ids=pos, attention_mask=mask, use_cache=False).last_hidden_state
        logits = head(h[:, ends]).float()
    allowed = list(range(2048)) + [EOS]
    return logits[..., allowed].reshape(-1, len(allowed))


def compare(ref, other):
    torch = _torch()
    lr, lo = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    t1 = lr.argmax(-1)
    off = other.argmax(-1) != t1
    d = (lo.gather(-1, t1[:, None]) - lr.gather(-1, t1[:, None])).abs().squeeze(-1)
    kl = (lr.exp() * (lr - lo)).sum(-1)
    return (off, d, kl), {"tokens": int(len(t1)), "off_top1": int(off.sum()), "mean_abs_dlogprob_top1": float(d.mean()),
                          "mean_kl": float(kl.mean())}


def paired_p(x, y):
    """Two-sided p of a paired t on per-token differences x - y (normal approximation; n is thousands)."""
    diff = (x - y).double()
    se = float(diff.std()) / math.sqrt(len(diff))
    return 1.0 if se == 0 else math.erfc(abs(float(diff.mean())) / se / math.sqrt(2))


def two_prop_p(x1, n1, x2, n2):
    p = (x1 + x2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2)) if 0 < p < 1 else 0
    return 1.0 if se == 0 else math.erfc(abs(x1 / n1 - x2 / n2) / se / math.sqrt(2))


def mcnemar_p(b, c):
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def measure(logits_by_kind):
    ref = logits_by_kind["f32"]
    margins = ref.topk(2, -1).values
    gap = margins[:, 0] - margins[:, 1]
    res, offs = {}, {}
    for kind in KINDS[1:]:
        offs[kind], res[kind] = compare(ref, logits_by_kind[kind])
    b, c = res["bf16"], res["mutant"]
    (off_b, d_b, kl_b), (off_c, d_c, kl_c) = offs["bf16"], offs["mutant"]
    only_b = int((off_b & ~off_c).sum())
    only_c = int((off_c & ~off_b).sum())
    res["mutant_vs_bf16"] = {
        "ratio": round(c["off_top1"] / max(b["off_top1"], 1), 3),
        "two_prop_p": round(two_prop_p(c["off_top1"], c["tokens"], b["off_top1"], b["tokens"]), 4),
        "off_only_bf16": only_b, "off_only_mutant": only_c, "mcnemar_p": round(mcnemar_p(only_b, only_c), 4),
        "argmax_differs": int((logits_by_kind["mutant"].argmax(-1) != logits_by_kind["bf16"].argmax(-1)).sum()),
        # the continuous, paired view: per token, is the mutant further from f32 than bf16 is?
        "dlogprob_ratio": round(float(d_c.mean() / d_b.mean()), 4), "dlogprob_paired_p": round(paired_p(d_c, d_b), 6),
        "kl_ratio": round(float(kl_c.mean() / kl_b.mean()), 4), "kl_paired_p": round(paired_p(kl_c, kl_b), 6)}
    res["f32_margin"] = {"median_logit_gap_top1_top2": round(float(gap.median()), 4),
                         "share_gap_below_0.05": round(float((gap < 0.05).float().mean()), 4)}
    for kind in KINDS[1:]:
        res[kind] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in res[kind].items()}
    return res


def massive_ratio(cp, x):
    """max |channel| / median |channel| at the input of the code predictor's first norm (per position)."""
    torch = _torch()
    seen = {}
    norm = cp.model.layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda m, i, o: [seen.setdefault("x", i[0].detach()), None][1])
    with torch.no_grad():
        cp.forward_finetune(inputs_embeds=x)
    hook.remove()
    a = seen["x"].abs()
    return round(float((a.max(-1).values / a.median(-1).values).median()), 1)


def run_build(tts, args, label):
    torch = _torch()
    t0 = time.time()
    cp_calls, t_calls, code_list = sample_streams(tts, args.frames, args.batch, args.seed)
    talker = tts.model.talker
    cp = talker.code_predictor
    x = cp_inputs(cp, cp_calls)
    out = {"streams": stream_stats(code_list), "massive_over_median_cp": massive_ratio(cp, x)}
    out["code_predictor"] = measure({k: cp_logits(cp, x, k) for k in KINDS})
    if not args.no_talker:
        out["talker"] = measure({k: talker_logits(talker, t_calls, k) for k in KINDS})
    for s in args.qk_scale:
        if s == 1:
            continue
        cp2 = copy.deepcopy(cp)
        with torch.no_grad():
            for mod in cp2.modules():
                if hasattr(mod, "q_norm"):
                    mod.q_norm.weight.mul_(s)
                    mod.k_norm.weight.mul_(s)
        out[f"code_predictor_qk_x{s:g}"] = measure({k: cp_logits(cp2, x, k) for k in KINDS})
    out["seconds"] = round(time.time() - t0, 1)
    print(f"[{label}] {json.dumps(out['code_predictor']['mutant_vs_bf16'])}", file=sys.stderr, flush=True)
    return out


def rope_angle_error(head_dim: int, theta: float, positions: int = 17):
    """max |cos/sin (mutant) - cos/sin (f32)| and the release's own bf16 rounding of cos/sin, positions 0..16."""
    torch = _torch()
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = torch.arange(positions, dtype=torch.float32)
    f32 = torch.outer(pos, inv)
    mut = torch.outer(pos.bfloat16(), inv.bfloat16())
    ref_c, ref_s = f32.cos(), f32.sin()
    err = max(float((mut.cos().float() - ref_c).abs().max()), float((mut.sin().float() - ref_s).abs().max()))
    rel = max(float((ref_c.bfloat16().float() - ref_c).abs().max()), float((ref_s.bfloat16().float() - ref_s).abs().max()))
    return {"head_dim": head_dim, "rope_theta": theta, "mutant_cos_sin_max_err": round(err, 5),
            "release_bf16_cos_sin_max_err": round(rel, 5),
            "max_angle_err_rad": round(float((mut.float() - f32).abs().max()), 5)}


def variance_error(d: int, ratio: float, n_massive: int, trials: int = 2000, seed: int = 0):
    """Relative error of the mutant's bf16 rsqrt(variance) against float32, on bf16 rows of width d."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(trials, d, generator=g)
    if ratio:
        x[:, :n_massive] = ratio * x.abs().median() * torch.tensor([(-1.0) ** i for i in range(n_massive)])
    x = x.bfloat16()
    ref = torch.rsqrt(x.float().pow(2).mean(-1))
    mut = torch.rsqrt(x.pow(2).mean(-1)).float()
    r = (mut / ref - 1).abs()
    return {"d": d, "ratio": ratio, "mean_rel_err": round(float(r.mean()), 5), "max_rel_err": round(float(r.max()), 5)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/hz"))
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", default="", help="extra HAZARD_RATIOs planted in memory on the plain build")
    ap.add_argument("--qk-scale", default="1", help="comma list of q_norm/k_norm weight multipliers")
    ap.add_argument("--no-talker", action="store_true")
    ap.add_argument("--predictor-head-dim", type=int, default=0,
                    help="also build the plain checkpoint with this code-predictor head_dim (8 in the tiny build, "
                         "128 in the released ones): how many RoPE frequencies the bf16 angles can get wrong")
    ap.add_argument("--only-head-dim", action="store_true", help="measure only the --predictor-head-dim build")
    args = ap.parse_args(argv)
    args.qk_scale = [float(s) for s in args.qk_scale.split(",") if s]
    with contextlib.redirect_stdout(sys.stderr):  # qwen-tts prints a flash-attn banner on import
        torch = _torch()
        from qwen_tts import Qwen3TTSModel
        from runners.reference import tiny_checkpoint as tc

    builds = {}
    variants = [] if args.only_head_dim else [("plain", False, 0), ("hazard", True, 0)]
    if args.predictor_head_dim:
        variants += [(f"plain_hd{args.predictor_head_dim}", False, args.predictor_head_dim)]
    for name, hz, head_dim in variants:
        out = args.store / name
        if not (out / "model.safetensors").exists():
            out.mkdir(parents=True, exist_ok=True)
            inner_config = tc.tts_config
            if head_dim:  # the same build but for the code predictor's head_dim
                def patched(tok, model_type, head_dim=head_dim):
                    config = inner_config(tok, model_type)
                    config["talker_config"]["code_predictor_config"]["head_dim"] = head_dim
                    return config
                tc.tts_config = patched
            try:
                tc._build_into(out, 0, "base", 0.0, listen=tc.LISTEN, hazard=hz)
            finally:
                tc.tts_config = inner_config
        builds[name] = out
    result = {"torch": torch.__version__, "frames": args.frames, "batch": args.batch, "builds": {}}
    for name, path in builds.items():
        tts = Qwen3TTSModel.from_pretrained(str(path), dtype=torch.float32, device_map="cpu")
        result["builds"][f"{name}" + (f"_r{tc.HAZARD_RATIO:g}" if name == "hazard" else "")] = run_build(tts, args, name)
    for r in [float(x) for x in args.ratios.split(",") if x and "plain" in builds]:
        tts = Qwen3TTSModel.from_pretrained(str(builds["plain"]), dtype=torch.float32, device_map="cpu")
        planted = tc.plant_hazard_(tts.model, 0, ratio=r)
        result["builds"][f"hazard_r{r:g}_in_memory"] = {**run_build(tts, args, f"r{r:g}"), "planted": planted}
    cfg = json.loads((builds[next(iter(builds))] / "config.json").read_text())["talker_config"]["code_predictor_config"]
    result["mechanism"] = {
        "rope": [rope_angle_error(cfg["head_dim"], cfg["rope_theta"]), rope_angle_error(128, 1e6)],
        "variance": [variance_error(16, 0, 0), variance_error(16, 1000, 1), variance_error(1024, 0, 0),
                     variance_error(1024, 1000, 4)]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
