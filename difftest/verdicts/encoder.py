"""The reference encoder: the candidate's reference codes against what qwen-tts's encoder makes
of the same voice (in its dtype and in bf16)."""

from __future__ import annotations

import numpy as np

from .evidence import Finding
from .policy import Policy


def encoder_agreement(theirs: np.ndarray, mine: np.ndarray, theirs_bf16=None) -> tuple[float, float | None]:
    """The share of reference-code entries agreeing with qwen-tts's encoder's, in its dtype and in bf16."""
    def agreement(ref: np.ndarray) -> float:
        n = min(len(ref), len(mine))
        return float((ref[:n] == mine[:n]).mean()) if n else 0.0

    bf16 = agreement(np.asarray(theirs_bf16)) if theirs_bf16 is not None and len(theirs_bf16) == len(theirs) else None
    return agreement(theirs), bf16


def encoder_disagrees(theirs: np.ndarray, mine: np.ndarray, policy: Policy, theirs_bf16=None) -> bool:
    """The encoder check's line: other length, or fewer entries agreeing (the closer dtype) than the policy allows."""
    agree, agree_bf16 = encoder_agreement(theirs, mine, theirs_bf16)
    return len(theirs) != len(mine) or max(agree, agree_bf16 or 0.0) < policy.encoder_min_agreement


def encoder_finding(theirs: np.ndarray, mine: np.ndarray, policy: Policy, comps: dict, at_talker: bool,
                     theirs_bf16: np.ndarray | None = None) -> Finding:
    """The candidate's reference codes (what its talker was prompted with) against qwen-tts's encoder's
    for the same voice, in the reference's dtype and, where the reference recorded it, in bf16 (the
    dtype vLLM-Omni encodes in): numerics move some entries, another voice's or another length of
    audio moves them all. The closer of the two decides. Measured on vLLM-Omni 0.30.0's bf16 encoder,
    tiny checkpoint: against float32 78-91% agree on a CPU without AMX, 10-13% with AMX; against
    qwen-tts's own encoder in bf16, 93% with AMX; another voice's codes agree by chance (1 in 2048)."""
    agree, agree_bf16 = encoder_agreement(theirs, mine, theirs_bf16)
    comps["codes"]["ref_codes_agreement"] = round(agree, 4)
    if agree_bf16 is not None:
        comps["codes"]["ref_codes_agreement_bf16"] = round(agree_bf16, 4)
        agree = max(agree, agree_bf16)
    if encoder_disagrees(theirs, mine, policy, theirs_bf16):
        what = (f"{len(mine)} frames where qwen-tts's encoder makes {len(theirs)} of the same voice"
                if len(theirs) != len(mine) else
                f"only {agree:.0%} of their entries agree with qwen-tts's"
                + (" (float32 or bf16)" if theirs_bf16 is not None else "")
                + f" (policy: {policy.encoder_min_agreement:.0%})")
        whose = ("the talker's reference codes" if at_talker else
                 "the reference codes the vocoder got (no talker stage captured: the encoder or the hand-off)")
        return Finding("reference_encoder_defect", f"{whose} are not what the voice encodes to: {what}",
                        frame=0, chunk=0, stage="reference_encoder")
    return Finding("code_divergence", f"reference codes differ from qwen-tts's ({len(mine)} against {len(theirs)} "
                                       f"frames, {agree:.0%} of entries agree)", frame=0, chunk=0,
                    stage="reference_encoder")
