"""What a run is asked to do beyond its suite, candidate and policy: `difftest run`'s options."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engines.reference import ReferenceOptions


@dataclass
class RunOptions:
    concurrency: int = 4
    pattern: str = "barrier"
    order: str = "suite"
    voice_mode: str = "inline"
    store: Path = Path("difftest-store")
    reference: ReferenceOptions = field(default_factory=ReferenceOptions)
    request_timeout: float = 600.0
    engine_health_timeout: float = 300.0
    vllm_omni: dict = field(default_factory=dict)  # difftest.engines.vllm_omni.VllmOmniOptions fields (python, device, ...)
    replace: bool = False  # discard a run folder's results that another candidate or configuration produced
    repeat: bool = True  # serve every segment once more at concurrency 1, after the others (history check)
    ray: dict | None = None  # {"address": ..., "workers": N}: the reference side on Ray (difftest.scale)
    candidate_dtype: str | None = None  # the candidate talker's dtype, declared (the measured null's numerics)
    candidate_vocoder_dtype: str | None = None  # the candidate vocoder's dtype, declared (the vocoder's null)
    reuse_unidentified: bool = False  # reuse a URL candidate's results though it says nothing of itself (url_reuse)
    require_paths: tuple = ()  # serving paths the run must show it took (verdicts/exercised.PATHS)
