"""The interface every verdict check has (issue 59, item 1), and the registry classify walks.

A check has a name, the verdicts its findings may be (rows of verdicts/catalogue.py), when it
applies, the note a segment gets when it does not, and `judge(evidence, context)`. A check that
reads another's findings asks the context for them (`ctx.of(name)`): the other is judged then, once,
so the order things are judged in follows from what reads what, while findings and notes keep the
registry's order. A rule runs after every check, over all their findings: where one finding
explains another away. The verdict is the most serious finding left, by the table's rank.

A new verdict: its row in the table, a check that gives it (or an existing check's `gives`), its
place in the registry (verdicts/checks.py), its tests. `Registry.extended` does the same without
touching the built-in registry (tests/test_verdict_checks.py registers and judges an example)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .catalogue import TABLE, Verdict
from .evidence import Evidence, Finding
from .policy import Policy


def _always(ev: Evidence) -> bool:
    return True


def _no_note(ev: Evidence) -> str | None:
    return None


@dataclass(frozen=True)
class Check:
    name: str
    gives: tuple[str, ...]  # the verdicts (finding kinds) its findings may be
    judge: Callable[[Evidence, Context], list[Finding]]
    applies: Callable[[Evidence], bool] = _always
    skipped: Callable[[Evidence], str | None] = _no_note  # the segment's note where it does not apply
    stops: bool = False  # a finding of this check ends the judgement (unusable input: nothing else can be said)


@dataclass(frozen=True)
class Rule:
    """After every check: `apply(ev, found, ctx)` returns the findings per check, some explained away
    (or placed elsewhere: a rule's own findings go under its name)."""
    name: str
    gives: tuple[str, ...]
    apply: Callable[[Evidence, dict[str, list[Finding]], Context], dict[str, list[Finding]]]


@dataclass
class Context:
    """One segment's judgement: the policy, what the comparisons measured (report.json's
    `comparisons`), the notes, the log-mels shared between comparisons, the findings so far."""
    ev: Evidence
    policy: Policy
    registry: Registry
    comps: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    mels: dict = field(default_factory=dict)
    found: dict[str, list[Finding]] = field(default_factory=dict)

    def of(self, name: str) -> list[Finding]:
        """The named check's findings, judged now if not yet ([] where it does not apply)."""
        if name not in self.found:
            check = self.registry.check(name)
            self.found[name] = self.registry.judged(check, check.judge(self.ev, self)) if check.applies(self.ev) else []
        return self.found[name]


@dataclass(frozen=True)
class Registry:
    checks: tuple[Check, ...]
    rules: tuple[Rule, ...]
    verdicts: tuple[Verdict, ...] = TABLE

    def __post_init__(self):
        names = [c.name for c in self.checks] + [r.name for r in self.rules]
        if len(names) != len(set(names)):
            raise ValueError(f"checks named twice: {sorted({n for n in names if names.count(n) > 1})}")
        kinds = {v.name: v for v in self.verdicts}
        ranks = [v.rank for v in self.verdicts if v.rank is not None]
        if len(ranks) != len(set(ranks)):
            raise ValueError("two verdicts share a rank: a segment's top finding would be a matter of order")
        for c in (*self.checks, *self.rules):
            if unknown := [k for k in c.gives if k not in kinds or kinds[k].rank is None]:
                raise ValueError(f"check {c.name!r} gives {unknown}: not ranked segment verdicts of the table")

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def rank(self, kind: str) -> float:
        return next(v.rank for v in self.verdicts if v.name == kind)

    def reported(self, kind: str) -> str:
        return next(v.reported_as or v.name for v in self.verdicts if v.name == kind)

    def judged(self, c: Check | Rule, findings: list[Finding]) -> list[Finding]:
        """`findings`, once each is one of the verdicts `c` says it gives."""
        if stray := [f.kind for f in findings if f.kind not in c.gives]:
            raise ValueError(f"check {c.name!r} found {stray}, which it does not declare (gives {list(c.gives)})")
        return findings

    def extended(self, check: Check, *, before: str, verdicts: tuple[Verdict, ...] = ()) -> Registry:
        """This registry with `check` judged (and its findings listed) just before the check named
        `before`, and the table with `verdicts` added."""
        i = [c.name for c in self.checks].index(before)
        return replace(self, checks=(*self.checks[:i], check, *self.checks[i:]), verdicts=(*self.verdicts, *verdicts))
