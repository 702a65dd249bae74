"""Teacher-forced scoring: how qwen-tts's talker would have scored a given code stream.

Generation samples one codebook-0 token per frame from the talker, then the
code predictor fills codebooks 1-15 from the talker's hidden state. Scoring
forces a given stream (T x 16) through the same two models and reads, at every
frame and codebook, what the reference would have thought of the forced token.

- The prompt is exactly what generation builds: `talker.generate` is shadowed
  on the instance for one call of the official `generate_*` method, which
  records its arguments (prompt embeddings, trailing text, pad embedding,
  logits-processor settings) and stops there. Nothing is re-implemented of the
  prompt layout, so a prompt bug in qwen-tts is the reference's as well.
- The talker is causal: one forward pass over prompt + the stream's frame
  embeddings gives every codebook-0 distribution (no KV cache, same positions:
  a batch of one has no padding).
- The code predictor runs once, batched over all frames, with each frame's
  16-position input (talker hidden state, codebooks 0-14) as its finetuning
  forward lays it out.
- Logits go through what generation applies (repetition penalty over the
  codebook-0 tokens so far, suppressed control tokens, EOS banned for the first
  `min_new_tokens` steps; with sampling, temperature then top-k then top-p).

Output per position: the forced token's log-probability, its rank, the top-1
token and its log-probability, the top-1/top-2 margin, and whether the token
lies inside the sampling support (for greedy decoding: whether it is the top-1).
Position (frame k, codebook 0) is the talker's; (k, 1..15) the code predictor's;
an optional extra codebook-0 row scores the stop (EOS) after the last frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from difftest import sampler_bank
from difftest.scores import DTYPES, FIELDS

# Bump when scoring changes what it writes for the same inputs: cached scores are keyed by it.
VERSION = 4  # 2: the sampling distribution's log-probability, expectation and variance; 3: support_gap;
# 4: the sampler bank (alt_*), the temperature likelihood grid and the PIT's mass_above (difftest/sampler_bank.py)


class Captured(Exception):
    """Raised by the shadowed `talker.generate` once it has recorded its arguments."""

    def __init__(self, kwargs):
        super().__init__("prompt captured")
        self.kwargs = kwargs


@dataclass
class Scores:
    arrays: dict  # FIELD -> (T, 16)
    eos: dict | None  # FIELD -> value for the EOS after the last frame; None when the stream ended at the cap
    settings: dict  # the decode settings the processors applied
    bank: dict | None = None  # the sampler bank's description (scores.ScoreFile.bank); None when nothing is sampled


def capture_prompt(tts, call) -> dict:
    """The talker's generate arguments for `call(tts)` (an official `generate_*` call), without generating."""
    talker = tts.model.talker

    def record(**kwargs):
        raise Captured(kwargs)

    talker.generate = record  # an instance attribute shadows the class method
    try:
        call(tts)
    except Captured as c:
        return c.kwargs
    finally:
        del talker.generate
    raise RuntimeError("qwen-tts returned without calling the talker's generate: no prompt to score against")


def override_ref_code(prompt_items: list, ref_codes: np.ndarray, torch):
    """Voice-clone prompt items with `ref_codes` as the in-context reference (the candidate's own)."""
    item = prompt_items[0]
    if item.ref_code is None:
        raise ValueError("reference codes given for a voice without in-context reference (x-vector only)")
    rc = torch.from_numpy(np.ascontiguousarray(ref_codes, dtype=np.int64)).to(item.ref_code.device)
    return [replace(item, ref_code=rc)]


def _processed(logits, prev_tokens, step, kw, torch, *, talker: bool):
    """Logits as generation's processors leave them (before the temperature)."""
    scores = logits.float().clone()
    if talker:
        penalty = float(kw.get("repetition_penalty") or 1.0)
        if penalty != 1.0 and len(prev_tokens):
            idx = torch.tensor(sorted(set(prev_tokens)), dtype=torch.long)
            s = scores[idx]
            scores[idx] = torch.where(s < 0, s * penalty, s / penalty)
        suppress = kw.get("suppress_tokens") or []
        if suppress:
            scores[torch.tensor(suppress, dtype=torch.long)] = -float("inf")
        if step < int(kw.get("min_new_tokens") or 0):
            scores[int(kw["eos_token_id"])] = -float("inf")
    return scores


def _support(scores, do_sample, top_k, top_p, temperature, torch):
    """(log-probabilities of the distribution decoding draws from, boolean support mask)."""
    if not do_sample:
        logp = torch.log_softmax(scores, dim=-1)
        return logp, scores == scores.max(dim=-1, keepdim=True).values
    t = float(temperature or 1.0)
    scaled = scores / t
    keep = torch.isfinite(scaled)
    k = int(top_k or 0)
    if 0 < k < scaled.shape[-1]:
        kth = torch.topk(scaled, k, dim=-1).values[..., -1:]
        keep &= scaled >= kth
    p = float(top_p if top_p is not None else 1.0)
    if p < 1.0:
        masked = scaled.masked_fill(~keep, -float("inf"))
        order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(order.values, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        keep_sorted = before < p
        keep_sorted[..., 0] = True
        nucleus = torch.zeros_like(keep)
        nucleus.scatter_(-1, order.indices, keep_sorted)
        keep &= nucleus
    return torch.log_softmax(scaled, dim=-1), keep


OUTSIDE = -100.0  # sample_logprob of a token outside the support (it cannot be drawn: -inf, kept finite)


def _rows(scores, logp, support, forced, sampling: bool, torch) -> dict:
    """Per-row statistics of the forced tokens; `scores`/`logp` are (N, V), `forced` (N,)."""
    idx = forced.view(-1, 1)
    lp_forced = logp.gather(-1, idx).squeeze(-1)
    s_forced = scores.gather(-1, idx)
    rank = (scores > s_forced).sum(dim=-1)
    top2 = torch.topk(logp, 2, dim=-1)
    inside = support.gather(-1, idx).squeeze(-1)
    zeros = torch.zeros_like(lp_forced)
    if sampling:
        lt = torch.log_softmax(logp.masked_fill(~support, -float("inf")), dim=-1)
        pt = lt.exp()
        lt0 = lt.masked_fill(~support, 0.0)
        expected = (pt * lt0).sum(-1)
        var = ((pt * lt0 * lt0).sum(-1) - expected * expected).clamp_min(0.0)
        sample_lp = torch.where(inside, lt.gather(-1, idx).squeeze(-1), torch.full_like(zeros, OUTSIDE))
        boundary = logp.masked_fill(~support, float("inf")).min(dim=-1).values
        support_gap = (boundary - lp_forced).clamp_min(0.0).masked_fill(inside, 0.0)
    else:
        expected = var = sample_lp = support_gap = zeros
    return {"logprob": lp_forced.numpy(), "rank": rank.numpy(), "top1": top2.indices[:, 0].numpy(),
            "top1_logprob": top2.values[:, 0].numpy(), "margin": (top2.values[:, 0] - top2.values[:, 1]).numpy(),
            "in_support": inside.numpy(), "sample_logprob": sample_lp.numpy(), "expected_logprob": expected.numpy(),
            "logprob_var": var.numpy(), "support_gap": support_gap.numpy()}


def _restrict(logp, keep, torch):
    """log-probabilities renormalised over `keep` (-inf outside)."""
    return torch.log_softmax(logp.masked_fill(~keep, -float("inf")), dim=-1)


def _xlogy_sum(p_log, diff):
    """sum over the vocabulary of exp(p_log) * diff, with 0 where exp(p_log) is 0."""
    w = p_log.exp()
    return (w * diff.masked_fill(w == 0, 0.0)).sum(-1)


def _on_columns(rows, alt: dict, cols, torch):
    """log q over its own support for the alternative `alt`, on the columns `cols` (N, M) only; -inf
    outside q's support. Exact wherever q's support lies within `cols` (top-k no wider than M) or q
    keeps the whole vocabulary without a nucleus (then only its normaliser needs every column)."""
    sub = rows.gather(-1, cols)
    if 0 < alt["top_k"] <= cols.shape[-1]:
        return _restrict(*_support(sub, True, alt["top_k"], alt["top_p"], alt["temperature"], torch), torch)
    if alt["top_p"] >= 1.0:
        scaled = rows / alt["temperature"]
        z = scaled.masked_fill(~torch.isfinite(scaled), -float("inf")).logsumexp(-1, keepdim=True)
        return (sub / alt["temperature"] - z).masked_fill(~torch.isfinite(sub), -float("inf"))
    return _restrict(*_support(rows, True, alt["top_k"], alt["top_p"], alt["temperature"], torch), torch).gather(-1, cols)


def _bank(rows_for, requested: dict, forced, settings: dict, site: str, torch) -> tuple[dict, dict]:
    """The sampler bank at one site's sampled rows (difftest/sampler_bank.py).

    `rows_for(params)` gives the (N, V) logits as the processors leave them for an alternative's
    parameters (before the temperature). Per row: for each alternative q, `alt_outside` (q's mass
    outside the requested support S), and with q' = q renormalised over S: `alt_llr` (log q'(x) -
    log p(x) at the forced token x), `alt_kl` (KL(q' || p): the mean llr when q' draws) and `alt_var`
    (its variance); `temp_loglik` (N, G): log p_T(x) over S for the grid temperatures; `mass_above`:
    p's mass on tokens ranked before x (more likely, or as likely with a lower id), the randomised
    probability-integral transform's lower end. Everything but q's normaliser is computed on the M
    columns of each row's largest logits that hold S and every top-k alternative's support (M = 50
    for top-k 50, not the whole codebook: 20x less work on the code predictor's 2048 entries)."""
    rows = rows_for(requested)
    alts = [(j, sampler_bank.alternative(settings, site, name)) for j, name in enumerate(sampler_bank.ALTERNATIVES)]
    ks = [requested["top_k"]] + [a["top_k"] for _, a in alts if a is not None and a["top_k"] > 0]
    m = rows.shape[-1] if requested["top_k"] <= 0 else min(rows.shape[-1], max(ks))
    cols = torch.topk(rows, m, dim=-1).indices  # the requested support is the top-k of these rows
    lp = _restrict(*_support(rows.gather(-1, cols), True, requested["top_k"], requested["top_p"],
                             requested["temperature"], torch), torch)
    keep = torch.isfinite(lp)
    idx = forced.view(-1, 1)
    at = (cols == idx).float().argmax(-1, keepdim=True)  # x's column (0 where x lies outside: not used)
    inside = (cols == idx).any(-1)
    lp_x = lp.gather(-1, at).squeeze(-1).masked_fill(~inside, -float("inf"))
    n, a = rows.shape[0], len(sampler_bank.ALTERNATIVES)
    out = {f: torch.full((n, a), float("nan")) for f in ("alt_llr", "alt_kl", "alt_var", "alt_outside")}
    for j, alt in alts:
        if alt is None:
            continue
        lq = _on_columns(rows if alt == requested else rows_for(alt), alt, cols, torch)
        inside_mass = lq.masked_fill(~keep, -float("inf")).logsumexp(-1)
        out["alt_outside"][:, j] = (1.0 - inside_mass.exp()).clamp(0.0, 1.0)
        lq_s = _restrict(lq, keep, torch)  # q' (NaN rows where q puts nothing on S)
        diff = (lq_s - lp).masked_fill(~keep, 0.0)
        kl = _xlogy_sum(lq_s, diff)
        out["alt_kl"][:, j] = kl
        out["alt_var"][:, j] = (_xlogy_sum(lq_s, diff * diff) - kl * kl).clamp_min(0.0)
        out["alt_llr"][:, j] = lq_s.gather(-1, at).squeeze(-1) - lp_x
    # Temperature likelihood over S (held fixed), every grid point at once: (N, G, M).
    vals = rows.gather(-1, cols).masked_fill(~keep, -float("inf"))
    grid = sampler_bank.temperature_grid(requested["temperature"])
    scaled = vals.unsqueeze(1) / torch.tensor(grid, dtype=vals.dtype).view(1, -1, 1)
    out["temp_loglik"] = torch.log_softmax(scaled, dim=-1).gather(-1, at.unsqueeze(1).expand(-1, len(grid), 1)).squeeze(-1)
    before = (lp > lp_x.unsqueeze(-1)) | ((lp == lp_x.unsqueeze(-1)) & (cols < idx))
    out["mass_above"] = (lp.exp() * before).sum(-1).clamp(0.0, 1.0)
    return {k: v.numpy() for k, v in out.items()}, {"applicable": [x is not None for _, x in alts],
                                                     "temperature_grid": grid}


def check_stream(codes: np.ndarray, n_groups: int, vocab: int, sub_vocab: int) -> np.ndarray:
    """`codes` as a (T, n_groups) int64 stream of ids the codebooks hold; ValueError names what is wrong."""
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 2 or codes.shape[1] != n_groups or codes.shape[0] == 0:
        raise ValueError(f"codes must be a non-empty (T, {n_groups}) stream, got {codes.shape}")
    if codes[:, 0].max() >= vocab or codes[:, 1:].max() >= sub_vocab or codes.min() < 0:
        raise ValueError(f"codes hold ids outside the codebooks ([0, {vocab}) for codebook 0, [0, {sub_vocab}) after)")
    return codes


def score_stream(tts, kwargs: dict, codes: np.ndarray, ended_by_eos: bool) -> Scores:
    """Teacher-force `codes` (T, 16) through the talker and code predictor under the captured prompt `kwargs`."""
    import torch

    talker = tts.model.talker
    cfg = talker.config
    n_groups = int(cfg.num_code_groups)
    codes = check_stream(codes, n_groups, int(cfg.vocab_size), int(cfg.code_predictor_config.vocab_size))
    T = codes.shape[0]
    device = talker.device
    c = torch.from_numpy(codes).to(device)
    prompt = kwargs["inputs_embeds"]
    if prompt.shape[0] != 1:
        raise ValueError("scoring handles one utterance at a time")
    trailing, pad = kwargs["trailing_text_hidden"], kwargs["tts_pad_embed"]
    with torch.inference_mode():
        emb0 = talker.get_input_embeddings()
        sub_embs = talker.code_predictor.get_input_embeddings()
        # Frame k's input to the talker: its 16 codes' embeddings summed, plus the k-th trailing text
        # embedding (the pad embedding once the text is used up), as the talker's forward adds them.
        frames = emb0(c[:, 0]) + sum(sub_embs[i - 1](c[:, i]) for i in range(1, n_groups))
        text = torch.cat([trailing[0, :min(T, trailing.shape[1])],
                          pad[0].expand(max(0, T - trailing.shape[1]), -1)], dim=0)
        full = torch.cat([prompt, (frames + text).unsqueeze(0).to(prompt.dtype)], dim=1)
        mask = torch.ones(full.shape[:2], dtype=torch.long, device=device)
        out = talker(inputs_embeds=full, attention_mask=mask, use_cache=False, output_hidden_states=True)
        P = prompt.shape[1]
        hidden = out.hidden_states[0][-1][0, P - 1:P + T]  # (T + 1, D): the states that chose each codebook-0 token
        logits0 = out.logits[0, P - 1:P + T].float().cpu()  # (T + 1, V)
        # Codebooks 1-15: the code predictor's 16-position input per frame, all frames at once.
        sub_in = torch.cat([hidden[:T].unsqueeze(1), emb0(c[:, :1])]
                           + [sub_embs[i - 1](c[:, i:i + 1]) for i in range(1, n_groups - 1)], dim=1)
        sub_logits = talker.code_predictor.forward_finetune(inputs_embeds=sub_in).logits.float().cpu()  # (T, 15, V')
    return score_logits(logits0, sub_logits, codes, kwargs, ended_by_eos)


def score_logits(logits0, sub_logits, codes: np.ndarray, kwargs: dict, ended_by_eos: bool) -> Scores:
    """The scores of a forced stream from the models' raw logits: `logits0` (T + 1, V), the talker's
    at each frame and at the stop after the last; `sub_logits` (T, G - 1, V'), the code predictor's
    for codebooks 1..G-1. `kwargs`: the talker's generate settings (sampling, repetition penalty,
    suppressed tokens, EOS, min_new_tokens) and the code predictor's (`subtalker_*`)."""
    import torch

    T, n_groups = codes.shape
    tokens0 = codes[:, 0].tolist() + ([int(kwargs["eos_token_id"])] if ended_by_eos else [])
    rows0 = torch.stack([_processed(logits0[k], tokens0[:k], k, kwargs, torch, talker=True)
                         for k in range(len(tokens0))])
    lp0, sup0 = _support(rows0, kwargs.get("do_sample"), kwargs.get("top_k"), kwargs.get("top_p"),
                         kwargs.get("temperature"), torch)
    r0 = _rows(rows0, lp0, sup0, torch.tensor(tokens0), bool(kwargs.get("do_sample")), torch)
    flat = sub_logits.reshape(T * (n_groups - 1), -1)
    lp1, sup1 = _support(flat, kwargs.get("subtalker_dosample"), kwargs.get("subtalker_top_k"),
                         kwargs.get("subtalker_top_p"), kwargs.get("subtalker_temperature"), torch)
    r1 = _rows(flat, lp1, sup1, torch.from_numpy(codes[:, 1:].reshape(-1)), bool(kwargs.get("subtalker_dosample")),
               torch)
    arrays = {}
    for f in FIELDS:
        a = np.empty((T, n_groups), dtype=DTYPES[f])
        a[:, 0] = r0[f][:T]
        a[:, 1:] = r1[f].reshape(T, n_groups - 1)
        arrays[f] = a
    eos = {f: r0[f][T].item() for f in FIELDS} if ended_by_eos else None  # python scalars: JSON
    settings = {k: kwargs.get(k) for k in ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty",
                                           "subtalker_dosample", "subtalker_top_k", "subtalker_top_p",
                                           "subtalker_temperature", "min_new_tokens", "max_new_tokens",
                                           "eos_token_id")}
    bank = None
    if kwargs.get("do_sample") or kwargs.get("subtalker_dosample"):
        by_penalty = {float(kwargs.get("repetition_penalty") or 1.0): rows0[:T]}

        def talker_rows(params):
            if not params["processed"]:
                return logits0[:T].float()
            r = params["repetition_penalty"]
            if r not in by_penalty:
                kw = {**kwargs, "repetition_penalty": r}
                by_penalty[r] = torch.stack([_processed(logits0[k], tokens0[:k], k, kw, torch, talker=True)
                                             for k in range(T)])
            return by_penalty[r]

        sites = {}
        width = {f: len(sampler_bank.ALTERNATIVES) for f in ("alt_llr", "alt_kl", "alt_var", "alt_outside")}
        width.update(temp_loglik=sampler_bank.GRID_POINTS, mass_above=None)
        for f, w in width.items():
            arrays[f] = np.full((T, n_groups) + ((w,) if w else ()), np.nan, dtype=np.float32)
        for site, rows_for, forced, cols in (
                ("talker", talker_rows, torch.from_numpy(codes[:, 0]), slice(0, 1)),
                ("code_predictor", lambda params: flat, torch.from_numpy(codes[:, 1:].reshape(-1)), slice(1, None))):
            requested = sampler_bank.site_parameters(settings, site)
            if requested is None:
                continue
            values, sites[site] = _bank(rows_for, requested, forced, settings, site, torch)
            for f, v in values.items():
                arrays[f][:, cols] = v.reshape((T, cols.stop - cols.start if cols.stop else n_groups - 1)
                                               + v.shape[1:])
        bank = {"alternatives": list(sampler_bank.ALTERNATIVES), "sites": sites}
    return Scores(arrays, eos, settings, bank)
