"""How to search: the first bad commit of a line of commits, from good/bad/skip answers.

Pure: it knows commits only as names in order and asks a `probe` callable for a
decision. It never installs, serves or runs anything (probe.py decides what a
commit is; builds.py makes it a candidate), so it is tested with a fake oracle.

    outcome = bisect(["good", "c1", ..., "bad"], probe)       # probe(commit) -> Vote (or "good"/"bad"/"skip")

- The ends are probed first (as mozregression does): a "good" end that is bad, or a
  "bad" end that is good, stops the search before any step is wasted.
- Then binary search on the commits strictly between the last known good and the
  first known bad. A skipped commit (does not install, server does not start, runs
  disagree) is set aside and the nearest untested commit to the middle is probed
  instead. When only skipped commits separate the two, the first bad commit is
  ambiguous: `suspects` lists every candidate.
- With n = len(commits) - 1 possible first-bad commits and no skips, the search
  makes exactly ceil(log2 n) probes between the ends in the worst case (2 more for
  the ends); each skip costs one more.
- `known`: decisions from an earlier, interrupted session; those commits are not
  probed again. The search is deterministic, so a resumed session walks the same
  path and only the undecided steps cost anything.

Flaky commits: `vote(run_once, repeats, agree)` runs one commit up to `repeats`
times and decides by `agree` alike answers (default: a majority), stopping as soon
as the decision is settled; when no answer can reach `agree`, the commit is skipped.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

GOOD, BAD, SKIP = "good", "bad", "skip"
DECISIONS = (GOOD, BAD, SKIP)

# Outcome.status
FOUND = "found"  # one first bad commit
AMBIGUOUS = "ambiguous"  # skipped commits hide which of `suspects` is the first bad one
GOOD_END_IS_BAD = "good-end-is-bad"
BAD_END_IS_GOOD = "bad-end-is-good"
END_SKIPPED = "end-skipped"  # an end could not be decided (does not install, server down, flaky)

GOOD_END, BAD_END, STEP = "good end", "bad end", "step"


@dataclass(frozen=True)
class Vote:
    """A commit's decision and the answers of the runs it came from."""

    decision: str
    outcomes: tuple[str, ...] = ()
    reason: str = ""

    def __post_init__(self):
        if self.decision not in DECISIONS:
            raise ValueError(f"decision {self.decision!r}: expected one of {', '.join(DECISIONS)}")


def agreement(repeats: int, agree: int | None = None) -> int:
    """How many alike answers decide a commit: `agree`, default a strict majority of `repeats`."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    need = repeats // 2 + 1 if agree is None else agree
    if not repeats / 2 < need <= repeats:
        raise ValueError(f"agree must be more than half of repeats and at most repeats "
                         f"({repeats // 2 + 1}..{repeats} for {repeats}), got {need}")
    return need


def tally(outcomes: Sequence[str], repeats: int, agree: int | None = None) -> str | None:
    """The decision these answers settle, or None while more runs could still change it."""
    need = agreement(repeats, agree)
    n = Counter(outcomes)
    if n[BAD] >= need:
        return BAD
    if n[GOOD] >= need:
        return GOOD
    left = repeats - len(outcomes)
    if max(n[GOOD], n[BAD]) + left < need:
        return SKIP
    return None


def _reason(outcomes: Sequence[str], decision: str, need: int) -> str:
    n = Counter(outcomes)
    said = ", ".join(f"{n[k]} {k}" for k in DECISIONS if n[k])
    if len(outcomes) == 1:
        return f"1 run: {outcomes[0]}"
    if decision == SKIP:
        return f"runs disagree ({said}); {need} alike needed"
    return f"{n[decision]} of {len(outcomes)} runs {decision} ({said})"


def vote(run_once: Callable[[int], str], repeats: int = 1, agree: int | None = None) -> Vote:
    """Run a commit (`run_once(i)` for i = 0, 1, ...) until its decision is settled."""
    need = agreement(repeats, agree)
    outcomes: list[str] = []
    while (decision := tally(outcomes, repeats, need)) is None:
        answer = run_once(len(outcomes))
        if answer not in DECISIONS:
            raise ValueError(f"run answered {answer!r}: expected one of {', '.join(DECISIONS)}")
        outcomes.append(answer)
    return Vote(decision, tuple(outcomes), _reason(outcomes, decision, need))


@dataclass(frozen=True)
class Step:
    commit: str
    role: str  # good end | bad end | step
    vote: Vote
    probed: bool  # False: decided in an earlier session (`known`)
    round: int = 0  # the round it was asked in (kary_bisect: the commits of a round are probed together)


@dataclass
class Outcome:
    status: str
    first_bad: str | None  # FOUND only
    last_good: str | None  # the latest commit known good (None when the good end is not)
    suspects: list[str]  # FOUND: [first_bad]; AMBIGUOUS: every commit that may be the first bad one
    steps: list[Step] = field(default_factory=list)

    @property
    def probes(self) -> int:
        """Commits probed in this session (decisions reused from `known` excluded)."""
        return sum(s.probed for s in self.steps)

    @property
    def rounds(self) -> int:
        """Rounds that probed something: the wall-clock cost when each round's probes run side by side."""
        return len({s.round for s in self.steps if s.probed})


def max_probes(commits: int) -> int:
    """The most probes a search over `commits` (ends included) makes without skips."""
    return math.ceil(math.log2(max(commits - 1, 1))) + 2


def max_rounds(commits: int, width: int) -> int:
    """The most rounds kary_bisect makes over `commits` (ends included, one round) without skips."""
    n, rounds = max(commits - 1, 1), 1
    while n > 1:
        n = math.ceil(n / (width + 1))
        rounds += 1
    return rounds


def _checked(commits: Sequence[str]) -> list[str]:
    commits = list(commits)
    if len(commits) < 2:
        raise ValueError("a bisect needs a good and a bad commit")
    if len(set(commits)) != len(commits):
        raise ValueError("commits must be distinct")
    return commits


def _as_vote(answer) -> Vote:
    return answer if isinstance(answer, Vote) else Vote(answer, (answer,), f"1 run: {answer}")


def bisect(commits: Sequence[str], probe: Callable[[str], Vote | str], known: Mapping[str, Vote] | None = None,
           check_ends: bool = True) -> Outcome:
    """The first bad commit of `commits` (oldest first; commits[0] said good, commits[-1] said bad).

    `probe(commit)` is called once per commit the search needs and has not got in `known`.
    With check_ends=False the ends are taken as stated without probing them."""
    commits = _checked(commits)
    known = dict(known or {})
    steps: list[Step] = []

    def ask(i: int, role: str) -> str:
        c = commits[i]
        if c in known:
            v, probed = known[c], False
        else:
            v, probed = _as_vote(probe(c)), True
            known[c] = v
        steps.append(Step(c, role, v, probed, len(steps) + 1))  # serial: every question a round of its own
        return v.decision

    n = len(commits)
    if check_ends:
        d = ask(0, GOOD_END)
        if d != GOOD:
            return Outcome(GOOD_END_IS_BAD if d == BAD else END_SKIPPED, None, None, [], steps)
        d = ask(n - 1, BAD_END)
        if d != BAD:
            return Outcome(BAD_END_IS_GOOD if d == GOOD else END_SKIPPED, None, commits[0], [], steps)
    lo, hi = 0, n - 1
    skipped: set[int] = set()
    while True:
        untested = [i for i in range(lo + 1, hi) if i not in skipped]
        if not untested:
            break
        middle = (lo + hi) / 2
        i = min(untested, key=lambda j: (abs(j - middle), j))
        d = ask(i, STEP)
        if d == GOOD:
            lo = i
        elif d == BAD:
            hi = i
        else:
            skipped.add(i)
    suspects = commits[lo + 1:hi + 1]
    if len(suspects) == 1:
        return Outcome(FOUND, suspects[0], commits[lo], suspects, steps)
    return Outcome(AMBIGUOUS, None, commits[lo], suspects, steps)


def spread(lo: int, hi: int, skipped: set[int], width: int) -> list[int]:
    """Up to `width` untested indices strictly between lo and hi, evenly spaced: each cuts the
    interval at its j/(width+1) point, moved to the nearest index not yet taken or skipped."""
    free = [i for i in range(lo + 1, hi) if i not in skipped]
    picked: list[int] = []
    for j in range(1, width + 1):
        left = [i for i in free if i not in picked]
        if not left:
            break
        target = lo + (hi - lo) * j / (width + 1)
        picked.append(min(left, key=lambda i: (abs(i - target), i)))
    return sorted(picked)


def kary_bisect(commits: Sequence[str], probe_many: Callable[[list[str]], Mapping[str, Vote | str]],
                width: int, known: Mapping[str, Vote] | None = None, check_ends: bool = True) -> Outcome:
    """The first bad commit, probing up to `width` commits per round side by side (a (width+1)-ary search).

    `probe_many(commits)` decides a round's commits together (in parallel) and returns each one's
    vote. A round cuts the open interval between the last known good and the first known bad at
    `width` evenly spaced commits; the new interval runs from the latest good below the first bad
    of the round to that bad. Skipped commits are set aside, as in `bisect`. width=1 asks the same
    commits as `bisect`, one per round; the ends are one round of two. Deterministic, so a resumed
    search (`known`) walks the same rounds and probes only what is undecided."""
    if width < 1:
        raise ValueError("width must be at least 1")
    commits = _checked(commits)
    known = dict(known or {})
    steps: list[Step] = []
    rounds = [0]

    def ask(indices: list[int], roles: list[str]) -> dict[int, str]:
        rounds[0] += 1
        todo = [commits[i] for i in indices if commits[i] not in known]
        got = {c: _as_vote(v) for c, v in (probe_many(todo) if todo else {}).items()}
        missing = [c for c in todo if c not in got]
        if missing:
            raise ValueError(f"probe_many did not decide {', '.join(missing)}")
        out = {}
        for i, role in zip(indices, roles):
            c = commits[i]
            probed = c in got
            v = got[c] if probed else known[c]
            known[c] = v
            steps.append(Step(c, role, v, probed, rounds[0]))
            out[i] = v.decision
        return out

    n = len(commits)
    if check_ends:
        ends = ask([0, n - 1], [GOOD_END, BAD_END]) if width > 1 else {**ask([0], [GOOD_END])}
        if ends[0] != GOOD:
            return Outcome(GOOD_END_IS_BAD if ends[0] == BAD else END_SKIPPED, None, None, [], steps)
        if n - 1 not in ends:
            ends.update(ask([n - 1], [BAD_END]))
        if ends[n - 1] != BAD:
            return Outcome(BAD_END_IS_GOOD if ends[n - 1] == GOOD else END_SKIPPED, None, commits[0], [], steps)
    lo, hi = 0, n - 1
    skipped: set[int] = set()
    while True:
        picked = spread(lo, hi, skipped, width)
        if not picked:
            break
        decided = ask(picked, [STEP] * len(picked))
        bads = [i for i, d in decided.items() if d == BAD]
        hi = min(bads, default=hi)
        lo = max([i for i, d in decided.items() if d == GOOD and i < hi], default=lo)
        skipped |= {i for i, d in decided.items() if d == SKIP}
    suspects = commits[lo + 1:hi + 1]
    if len(suspects) == 1:
        return Outcome(FOUND, suspects[0], commits[lo], suspects, steps)
    return Outcome(AMBIGUOUS, None, commits[lo], suspects, steps)
