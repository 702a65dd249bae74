"""Delta debugging of one finding: the smallest case that still gives the same verdict at the same stage.

A `Case` is what one probe serves: which requests (in the order sent), at which concurrency and
arrival, under which candidate settings, with which edits to the requests (fewer words, fewer
frames generated, whole 80 ms frames cut from a reference). `shrink(start, probe, ...)` tries
smaller cases in a fixed order and keeps each one that still reproduces:

1. requests: the target alone at concurrency 1 first (a finding that needs no concurrency ends
   there); the target and its donor alone; otherwise ddmin (Zeller) over the other requests of
   its wave, the target and its donor kept;
2. concurrency: the lowest that still shows it;
3. arrival: barrier, suite order (where the run used another);
4. settings: each candidate setting dropped, one at a time;
5. frames: max_new_tokens halved while it still shows;
6. text: the target's text halved by words, then its last words dropped one at a time;
7. reference: each voice's reference halved by whole 80 ms frames at its own rate (its remainder
   mod 1920 samples once resampled to 24 kHz kept: hand-off bugs turn on it).

`probe(case) -> bool` is the whole interface to the candidate (difftest.repro.probe runs it; the
tests give it a double), so this module runs without one. Deterministic: the same probe answers
give the same steps. Bounded: at most `budget` probes; on exhaustion the smallest case found so
far is returned, marked incomplete.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from ..suites.suite import content_hash

STEPS = ("requests", "concurrency", "arrival", "settings", "frames", "text", "reference")
MIN_REF_FRAMES = 13  # 1.04 s: vLLM-Omni refuses a reference under 1 s (HTTP 400, "Reference audio too short")


@dataclass(frozen=True)
class Case:
    segments: tuple  # segment ids, in the order they are sent
    concurrency: int
    pattern: str = "barrier"
    order: str = "suite"
    settings: tuple = ()  # (name, JSON text) of the candidate's settings (VllmOmniOptions fields)
    edits: tuple = ()  # (segment id or voice id, field, value): text, max_new_tokens, ref_samples
    attempt: int = 0  # a repetition of the same case (scheduling-dependent findings)

    def key(self) -> str:
        return content_hash(asdict(self))

    def edit(self, who: str, name: str):
        for w, n, v in self.edits:
            if (w, n) == (who, name):
                return v
        return None

    def with_edit(self, who: str, name: str, value) -> "Case":
        rest = tuple(e for e in self.edits if (e[0], e[1]) != (who, name))
        return replace(self, edits=tuple(sorted(rest + ((who, name, value),), key=lambda e: (e[0], e[1]))))

    def describe(self) -> str:
        s = f"{len(self.segments)} request(s) [{', '.join(self.segments)}] at concurrency {self.concurrency}, {self.pattern}"
        if self.settings:
            s += f", settings {', '.join(f'{k}={v}' for k, v in self.settings)}"
        for who, name, value in self.edits:
            s += f", {'all' if who == '*' else who} {name} {value if name != 'text' else repr(value)}"
        return s


@dataclass(frozen=True)
class Subject:
    """What the case must keep showing, and what the search may change."""

    target: str
    donor: str | None = None
    words: dict = field(default_factory=dict)  # segment id -> its text
    max_new_tokens: dict = field(default_factory=dict)  # segment id -> the suite's value
    # segment id -> (voice id, reference frames at its own rate[, that rate: 24000 when left out])
    voices: dict = field(default_factory=dict)


@dataclass
class Shrunk:
    case: Case
    probes: int = 0  # probes asked for (cached ones included)
    steps: list = field(default_factory=list)  # per step: {"step", "tried", "kept", "case"}
    complete: bool = True  # False: the budget ran out before every step was done
    reproduced: bool = True  # False: the starting case did not reproduce in any attempt


class _Budget(Exception):
    pass


def settings_of(options: dict) -> tuple:
    """The candidate's settings as a case holds them: sorted (name, JSON) pairs."""
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in (options or {}).items()))


def ddmin(items: list, keep: Callable[[list], bool]) -> list:
    """The smallest sublist (1-minimal) for which keep() holds, by Zeller's ddmin; keep(items) is
    assumed. The order of items is kept in every sublist tried."""
    n = 2
    while len(items) >= 2:
        size = -(-len(items) // n)
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        for i, part in enumerate(parts):  # a part alone
            if keep(part):
                items, n = part, 2
                break
        else:
            for i in range(len(parts)):  # everything but a part
                rest = [x for j, p in enumerate(parts) if j != i for x in p]
                if keep(rest):
                    items, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    break
                n = min(len(items), 2 * n)
    if len(items) == 1 and keep([]):
        return []
    return items


def shrink(start: Case, subject: Subject, probe: Callable[[Case], bool], *, budget: int = 40,
           repeats: int = 1, tries: int = 1, steps=STEPS, on_step=lambda name, case: None) -> Shrunk:
    """The smallest case that still reproduces. `repeats`: attempts of the starting case before
    it is called not reproduced (a scheduling-dependent finding may pass a try). `tries`: attempts
    of every smaller case before it is given up (2 for a finding that depends on scheduling: a
    leak's donor is whichever request the engine took last)."""
    out = Shrunk(start)

    def one(case: Case) -> bool:
        if out.probes >= budget:
            raise _Budget
        out.probes += 1
        return probe(case)

    def attempt(case: Case) -> bool:
        return any(one(replace(case, attempt=k)) for k in range(max(tries, 1)))

    try:
        for k in range(max(repeats, 1)):
            if one(replace(start, attempt=k)):
                out.case = replace(start, attempt=k)
                break
        else:
            out.reproduced = False
            return out
        for name in steps:
            before, tried = out.case, out.probes
            on_step(name, out.case)
            out.case = _STEPS[name](out.case, subject, attempt)
            out.steps.append({"step": name, "tried": out.probes - tried, "kept": out.case != before,
                              "case": out.case.describe()})
    except _Budget:
        out.complete = False
    return out


def _requests(case: Case, subject: Subject, attempt) -> Case:
    alone = replace(case, segments=(subject.target,), concurrency=1, pattern="barrier", order="suite")
    if len(case.segments) > 1 and subject.donor is None and attempt(alone):
        return alone
    fixed = {subject.target, subject.donor}
    others = [s for s in case.segments if s not in fixed]

    def keep(subset: list) -> bool:
        chosen = set(subset) | fixed
        trial = replace(case, segments=tuple(s for s in case.segments if s in chosen))
        return trial == case or attempt(trial)

    # the target and its donor alone first: the seed's answer, and a subset ddmin itself never tries
    # (without a donor that is the target alone, tried above already)
    best = [] if others and subject.donor is not None and keep([]) else ddmin(others, keep)
    chosen = set(best) | fixed
    return replace(case, segments=tuple(s for s in case.segments if s in chosen))


def _concurrency(case: Case, subject: Subject, attempt) -> Case:
    # more in flight than there are requests changes nothing a barrier sends: start at that many
    case = replace(case, concurrency=min(case.concurrency, len(case.segments)))
    for c in range(1, case.concurrency):
        trial = replace(case, concurrency=c)
        if attempt(trial):
            return trial
    return case


def _arrival(case: Case, subject: Subject, attempt) -> Case:
    for field_name, simplest in (("pattern", "barrier"), ("order", "suite")):
        if getattr(case, field_name) != simplest:
            trial = replace(case, **{field_name: simplest})
            if attempt(trial):
                case = trial
    return case


def _settings(case: Case, subject: Subject, attempt) -> Case:
    for item in list(case.settings):
        trial = replace(case, settings=tuple(x for x in case.settings if x != item))
        if attempt(trial):
            case = trial
    return case


def _frames(case: Case, subject: Subject, attempt) -> Case:
    now = max(case.edit("*", "max_new_tokens") or 0,
              max(subject.max_new_tokens.get(s, 0) for s in case.segments)) or 0
    while now // 2 >= 2:
        trial = case.with_edit("*", "max_new_tokens", now // 2)
        if not attempt(trial):
            break
        case, now = trial, now // 2
    return case


def _text(case: Case, subject: Subject, attempt) -> Case:
    words = (case.edit(subject.target, "text") or subject.words.get(subject.target, "")).split()
    while len(words) >= 2:  # halves first
        trial = case.with_edit(subject.target, "text", " ".join(words[: -(-len(words) // 2)]))
        if not attempt(trial):
            break
        case, words = trial, words[: -(-len(words) // 2)]
    while len(words) >= 2:  # then a word at a time from the end
        trial = case.with_edit(subject.target, "text", " ".join(words[:-1]))
        if not attempt(trial):
            break
        case, words = trial, words[:-1]
    return case


def cut_reference(samples: int, sample_rate: int = SAMPLE_RATE) -> int | None:
    """A reference about half as long, cut by whole 80 ms frames (sample_rate * 0.08 samples at
    the file's rate; 1920 at 24 kHz) so that its remainder mod 1920 once resampled to 24 kHz stays
    (ceil(n * 24000 / rate) loses exactly 1920 a frame cut); None when it is already at the floor.
    At a rate whose 80 ms is no whole number of samples (one not a multiple of 25 Hz), frames are
    cut only in groups that are: fewer, never a fraction."""
    step_num, step_den = sample_rate * SAMPLES_PER_FRAME, SAMPLE_RATE  # one frame: step_num / step_den samples
    frames = samples * step_den // step_num  # whole 24 kHz frames: (ceil(n * 24000 / rate)) // 1920
    keep = max(frames - frames // 2, MIN_REF_FRAMES)
    group = step_den // math.gcd(step_num, step_den)  # frames whose length is a whole number of samples
    cut = (frames - keep) // group * group
    if cut <= 0:
        return None
    return samples - cut * step_num // step_den


def _reference(case: Case, subject: Subject, attempt) -> Case:
    voices = {}
    for s in case.segments:  # each voice of the case once, the target's first
        if s in subject.voices:
            v = subject.voices[s]
            voices.setdefault(v[0], (v[1], v[2] if len(v) > 2 else SAMPLE_RATE))
    for vid in sorted(voices, key=lambda v: v != subject.voices.get(subject.target, ("",))[0]):
        now, rate = case.edit(vid, "ref_samples") or voices[vid][0], voices[vid][1]
        while (shorter := cut_reference(now, rate)) is not None:
            trial = case.with_edit(vid, "ref_samples", shorter)
            if not attempt(trial):
                break
            case, now = trial, shorter
    return case


_STEPS = {"requests": _requests, "concurrency": _concurrency, "arrival": _arrival, "settings": _settings,
          "frames": _frames, "text": _text, "reference": _reference}
