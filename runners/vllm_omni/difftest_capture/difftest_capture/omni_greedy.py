"""Opt-in (`DIFFTEST_OMNI_SUBTALKER_GREEDY=1`, set by difftest's deploy overlay for the talker's stage):
Qwen3-Omni's codebooks 1-15 chosen greedily, the test setting the reference records as
`subtalker_greedy` (runners/reference_omni/engine.py).

vLLM-Omni 0.30's Qwen3-Omni code predictor samples in its "stored" mode whatever the deploy or the
request says: top-k 50 and top-p 0.8, then Gumbel-max with noise from the global torch RNG
(`common/qwen3_code_predictor.py`; `talker_mtp` drops the sub-talker sampling parameters the runner
hands it). Its own `set_sampling_params(top_k=1)` is not greedy: the top-k mask keeps every tied
maximum, bf16 logits tie, and the noise picks among them (measured: two identical requests first
differed at frame 3, codebook 15). Here the Gumbel draw of that one class is replaced by the first
maximal index, as torch's and transformers' greedy choose; the masks before it never remove the
maximum, so this is the argmax of the logits. Qwen3-TTS's predictor (another class) is untouched."""

from __future__ import annotations

import logging

from runners.vllm_omni.difftest_capture.difftest_capture.after_import import when_imported

ENV = "DIFFTEST_OMNI_SUBTALKER_GREEDY"
MODULE = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_code_predictor_mtp"
MARK = "__difftest_greedy__"

logger = logging.getLogger("vllm.difftest_capture")


def _first_max(cls, logits, generator=None, uniforms=None):
    return logits.float().argmax(dim=-1, keepdim=True)


def patch(module) -> None:
    cls = module.Qwen3OmniMoeTalkerCodePredictor
    if getattr(cls, MARK, False):
        return
    cls._sample_codes_gumbel = classmethod(_first_max)
    setattr(cls, MARK, True)
    logger.info("difftest: %s set: Qwen3-Omni's codebooks 1-15 are chosen greedily", ENV)


def install() -> None:
    when_imported(MODULE, patch)
