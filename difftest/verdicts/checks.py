"""The registry: the checks in the order their findings and notes are listed, and the rules after
them (verdicts/check.py says how classify walks it)."""

from __future__ import annotations

from .check import Registry
from .concurrency import CONCURRENCY
from .handoff import HANDOFF, STAGES
from .headline import HEADLINE
from .history import HISTORY
from .rules import RULES
from .talker import FORCED
from .talker_input import TALKER_INPUT
from .usable import SERVED, USABLE
from .vocoder import VOCODER

REGISTRY = Registry(
    checks=(
        USABLE,  # errors, missing or unusable results: nothing else is judged
        SERVED,  # notes only: no codes, a preemption
        HANDOFF,  # reads the vocoder's findings (where the audio shows a wrong prefix)
        STAGES,
        TALKER_INPUT,
        VOCODER,
        CONCURRENCY,
        HISTORY,
        FORCED,
        HEADLINE,
    ),
    rules=RULES,
)
