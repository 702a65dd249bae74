"""The pure bisection (difftest/bisect/search.py) against fake oracles: exact probe sequences and
counts, skips, flaky majorities, resuming an interrupted search."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from difftest.bisect import search
from difftest.bisect.search import (
    AMBIGUOUS,
    BAD,
    BAD_END_IS_GOOD,
    END_SKIPPED,
    FOUND,
    GOOD,
    GOOD_END_IS_BAD,
    SKIP,
    Vote,
    bisect,
    max_probes,
    tally,
    vote,
)


def line(n):
    return [f"c{i}" for i in range(n)]


class Oracle:
    """First bad at index k; `skips` answer skip; records every probe."""

    def __init__(self, k, skips=(), flaky=None):
        self.k, self.skips, self.flaky = k, set(skips), flaky or {}
        self.asked = []

    def __call__(self, commit):
        self.asked.append(commit)
        i = int(commit[1:])
        if i in self.skips:
            return SKIP
        return BAD if i >= self.k else GOOD


def test_exact_probe_sequence_ten_commits():
    o = Oracle(6)
    out = bisect(line(10), o)
    # ends first, then the middle of (0, 9) -> 4 (ties go low), of (4, 9) -> 6, of (4, 6) -> 5
    assert o.asked == ["c0", "c9", "c4", "c6", "c5"]
    assert (out.status, out.first_bad, out.last_good, out.suspects) == (FOUND, "c6", "c5", ["c6"])
    assert out.probes == 5 and [s.role for s in out.steps] == ["good end", "bad end", "step", "step", "step"]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 17, 33, 100])
def test_every_culprit_found_within_ceil_log2_plus_two(n):
    worst = 0
    for k in range(1, n):
        o = Oracle(k)
        out = bisect(line(n), o)
        assert out.status == FOUND and out.first_bad == f"c{k}"
        assert len(o.asked) == len(set(o.asked)) == out.probes  # nothing probed twice
        worst = max(worst, out.probes)
    assert worst == max_probes(n) == math.ceil(math.log2(n - 1)) + 2  # the bound is reached, never passed


def test_two_commits_need_only_the_ends():
    out = bisect(["good", "bad"], lambda c: GOOD if c == "good" else BAD)
    assert out.status == FOUND and out.first_bad == "bad" and out.probes == 2


def test_a_skipped_middle_costs_one_probe_and_moves_to_its_neighbour():
    o = Oracle(6, skips={4})
    out = bisect(line(10), o)
    assert o.asked == ["c0", "c9", "c4", "c5", "c7", "c6"]
    assert out.status == FOUND and out.first_bad == "c6" and out.probes == 6
    assert [s.vote.decision for s in out.steps] == [GOOD, BAD, SKIP, GOOD, BAD, BAD]


def test_skips_that_hide_the_culprit_leave_suspects():
    o = Oracle(5, skips={4, 5})
    out = bisect(line(8), o)
    assert out.status == AMBIGUOUS and out.first_bad is None
    assert out.suspects == ["c4", "c5", "c6"] and out.last_good == "c3"


def test_everything_skipped_between_the_ends():
    out = bisect(line(5), Oracle(2, skips={1, 2, 3}))
    assert out.status == AMBIGUOUS and out.suspects == ["c1", "c2", "c3", "c4"] and out.last_good == "c0"


@pytest.mark.parametrize("answers, status, probes", [
    ({"c0": BAD}, GOOD_END_IS_BAD, 1),  # the bad end is not even built
    ({"c0": SKIP}, END_SKIPPED, 1),
    ({"c0": GOOD, "c5": GOOD}, BAD_END_IS_GOOD, 2),
    ({"c0": GOOD, "c5": SKIP}, END_SKIPPED, 2),
])
def test_ends_are_checked_first(answers, status, probes):
    asked = []
    out = bisect(line(6), lambda c: asked.append(c) or answers.get(c, BAD))
    assert out.status == status and out.probes == probes == len(asked) and out.first_bad is None


def test_ends_taken_on_trust():
    o = Oracle(3)
    out = bisect(line(6), o, check_ends=False)
    assert "c0" not in o.asked and "c5" not in o.asked and out.first_bad == "c3"


def test_bad_input():
    with pytest.raises(ValueError):
        bisect(["only"], lambda c: GOOD)
    with pytest.raises(ValueError):
        bisect(["a", "a"], lambda c: GOOD)
    with pytest.raises(ValueError):
        bisect(line(3), lambda c: "maybe")


# -- flaky candidates: repeats and a majority ------------------------------------------------------

def scripted(*answers):
    calls = []

    def run_once(i):
        calls.append(i)
        return answers[i]
    return run_once, calls


@pytest.mark.parametrize("answers, repeats, agree, decision, runs", [
    ((BAD,), 1, None, BAD, 1),
    ((SKIP,), 1, None, SKIP, 1),
    ((BAD, BAD, GOOD), 3, None, BAD, 2),  # settled after two alike: the third never runs
    ((BAD, GOOD, BAD), 3, None, BAD, 3),  # the majority of a flaky commit
    ((GOOD, BAD, GOOD), 3, None, GOOD, 3),
    ((BAD, GOOD, SKIP), 3, None, SKIP, 3),  # nothing reaches 2: disagree too much
    ((SKIP, SKIP, BAD), 3, None, SKIP, 2),  # after two skips no answer can reach 2
    ((BAD, GOOD, GOOD, BAD), 4, None, SKIP, 4),  # 3 of 4 needed
    ((BAD, GOOD, BAD, BAD), 4, None, BAD, 4),
    ((BAD, BAD, GOOD, BAD, BAD), 5, 4, BAD, 5),
    ((BAD, GOOD, BAD, GOOD), 5, 4, SKIP, 4),  # 4 of 5 unreachable after two of each
])
def test_vote(answers, repeats, agree, decision, runs):
    run_once, calls = scripted(*answers)
    v = vote(run_once, repeats, agree)
    assert v.decision == decision and calls == list(range(runs)) and v.outcomes == answers[:runs]
    assert v.reason


def test_agreement_must_be_a_majority():
    for repeats, agree in ((3, 1), (4, 2), (3, 4), (0, None)):
        with pytest.raises(ValueError):
            search.agreement(repeats, agree)
    assert search.agreement(4) == 3 and search.agreement(1) == 1
    assert tally([], 3) is None and tally([BAD], 3) is None


def test_flaky_commit_decided_by_majority_inside_a_bisect():
    """c7 is bad but shows it only on odd runs (deterministic flake): 3 repeats still call it bad."""
    counts = {}

    def run_once_for(commit):
        def run_once(i):
            counts[commit] = counts.get(commit, 0) + 1
            k = int(commit[1:])
            if k == 7:
                return BAD if counts[commit] % 2 == 1 else GOOD
            return BAD if k >= 6 else GOOD
        return run_once

    out = bisect(line(10), lambda c: vote(run_once_for(c), repeats=3), known={"c4": Vote(SKIP, (SKIP,), "no build")})
    assert out.status == FOUND and out.first_bad == "c6"
    by = {s.commit: s for s in out.steps}
    assert by["c7"].vote.outcomes == (BAD, GOOD, BAD) and by["c7"].vote.decision == BAD
    assert by["c4"].probed is False  # from `known`
    assert counts == {"c0": 2, "c9": 2, "c5": 2, "c7": 3, "c6": 2}


def test_one_run_would_have_been_fooled_by_the_flake():
    seen = {"n": 0}

    def once(c):
        if c == "c7":
            seen["n"] += 1
            return GOOD if seen["n"] == 1 else BAD  # the flaky commit passes on its first run
        return BAD if int(c[1:]) >= 6 else GOOD

    out = bisect(line(10), once, known={"c4": Vote(SKIP)})
    assert out.first_bad == "c8"  # wrong: why --repeats exists


# -- resume --------------------------------------------------------------------------------------

def test_resume_after_an_interruption_probes_no_decided_commit_again():
    o = Oracle(6, skips={4})
    full = bisect(line(10), Oracle(6, skips={4}))
    decided = {}

    def interrupted(commit):
        if len(decided) == 3:
            raise KeyboardInterrupt
        decided[commit] = Vote(o(commit))
        return decided[commit]

    with pytest.raises(KeyboardInterrupt):
        bisect(line(10), interrupted)
    assert list(decided) == ["c0", "c9", "c4"]
    again = Oracle(6, skips={4})
    out = bisect(line(10), again, known=decided)
    assert again.asked == ["c5", "c7", "c6"]  # the rest of the same path
    assert out.first_bad == full.first_bad == "c6" and out.probes == 3
    assert [s.commit for s in out.steps] == [s.commit for s in full.steps]
    assert [s.probed for s in out.steps] == [False, False, False, True, True, True]


def test_resume_of_a_finished_search_probes_nothing():
    first = bisect(line(12), Oracle(9))
    known = {s.commit: s.vote for s in first.steps}
    out = bisect(line(12), lambda c: pytest.fail(f"probed {c} again"), known=known)
    assert out.first_bad == "c9" and out.probes == 0


@settings(max_examples=300, deadline=None)
@given(st.integers(3, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n - 1),
                                                      st.sets(st.integers(1, n - 2), max_size=n))))
def test_any_skips_never_hide_the_culprit_outside_the_suspects(case):
    n, k, skips = case
    o = Oracle(k, skips=skips)
    out = bisect(line(n), o)
    assert f"c{k}" in out.suspects
    assert out.status == (FOUND if out.suspects == [f"c{k}"] else AMBIGUOUS)
    idx = [int(c[1:]) for c in out.suspects]
    assert idx == list(range(idx[0], idx[-1] + 1))  # a contiguous run ending at a known bad commit
    assert all(i in skips for i in idx[:-1])
    assert len(o.asked) == len(set(o.asked)) <= max_probes(n) + len(skips)


# --- side by side: kary_bisect ---

def _many(oracle):
    return lambda commits: {c: oracle(c) for c in commits}


def test_one_probe_a_round_asks_what_the_binary_search_asks():
    serial, side = Oracle(6), Oracle(6)
    a, b = bisect(line(10), serial), search.kary_bisect(line(10), _many(side), 1)
    assert side.asked == serial.asked and (a.first_bad, a.probes) == (b.first_bad, b.probes)
    assert b.rounds == 5  # the ends are two rounds of one


def test_exact_rounds_of_three_ten_commits():
    o = Oracle(6)
    out = search.kary_bisect(line(10), _many(o), 3)
    # round 1: both ends; round 2: (0, 9) cut at 9/4, 9/2, 27/4 -> c2, c4, c7; round 3: (4, 7) -> c5, c6
    assert o.asked == ["c0", "c9", "c2", "c4", "c7", "c5", "c6"]
    assert [s.round for s in out.steps] == [1, 1, 2, 2, 2, 3, 3]
    assert (out.status, out.first_bad, out.last_good, out.rounds) == (FOUND, "c6", "c5", 3)


@pytest.mark.parametrize("width", [2, 3, 4, 7])
@pytest.mark.parametrize("n", [2, 3, 10, 17, 65, 100])
def test_side_by_side_names_the_serial_culprit_in_fewer_rounds(n, width):
    for k in range(1, n):
        serial = bisect(line(n), Oracle(k))
        side = search.kary_bisect(line(n), _many(Oracle(k)), width)
        assert side.first_bad == serial.first_bad == f"c{k}"
        assert side.rounds <= search.max_rounds(n, width) and side.rounds <= serial.rounds
        if n >= 10:
            assert side.rounds < serial.rounds


@settings(max_examples=200, deadline=None)
@given(n=st.integers(3, 40), data=st.data())
def test_side_by_side_with_skips_never_hides_the_culprit(n, data):
    k = data.draw(st.integers(1, n - 1))
    skips = data.draw(st.sets(st.integers(1, n - 2), max_size=n // 2)) - {k}
    width = data.draw(st.integers(1, 5))
    out = search.kary_bisect(line(n), _many(Oracle(k, skips)), width)
    assert out.status in (FOUND, AMBIGUOUS)
    assert f"c{k}" in out.suspects and (out.status != FOUND or out.first_bad == f"c{k}")


def test_side_by_side_resumes_without_probing_a_decided_commit():
    first = Oracle(6)
    interrupted = []

    def stop_in_round_3(commits):
        if "c5" in commits:
            raise KeyboardInterrupt
        got = _many(first)(commits)
        interrupted.extend(got)
        return got

    with pytest.raises(KeyboardInterrupt):
        search.kary_bisect(line(10), stop_in_round_3, 3)
    known = {c: Vote(first(c)) for c in interrupted}
    second = Oracle(6)
    out = search.kary_bisect(line(10), _many(second), 3, known=known)
    assert second.asked == ["c5", "c6"] and out.first_bad == "c6" and out.rounds == 1


def test_side_by_side_bad_input():
    with pytest.raises(ValueError, match="width"):
        search.kary_bisect(line(4), _many(Oracle(1)), 0)
    with pytest.raises(ValueError, match="did not decide c"):
        search.kary_bisect(line(4), lambda commits: {}, 2)
