"""The capture plugin's count of its own time (runners/vllm_omni/difftest_capture/.../cost.py), which
benchmarks/bench_capture.py reads: only the capture's code is counted, not the engine function it
wraps, and the per-process file is flushed on a call at most every FLUSH_S. A fake clock: no timing."""

import json

import pytest

from runners.vllm_omni.difftest_capture.difftest_capture import cost, hooks


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch, tmp_path):
    c = Clock()
    monkeypatch.setattr(cost.time, "perf_counter", c)
    fresh = cost.Cost()
    fresh.configure(tmp_path)
    monkeypatch.setattr(cost, "COST", fresh)
    monkeypatch.setattr(hooks, "COST", fresh)
    return c, fresh


def _file(c: cost.Cost) -> dict:
    return json.loads(c.path.read_text())


def test_the_count_is_flushed_on_a_call_at_most_every_quarter_second(clock):
    c, acc = clock
    acc.add(0.1)
    assert _file(acc) == {"seconds": 0.1, "calls": 1}  # the first call flushes
    c.t += 0.1
    acc.add(0.2)
    assert _file(acc)["calls"] == 1  # 0.1 s later: not yet
    c.t += cost.FLUSH_S
    acc.add(0.3)
    assert _file(acc) == {"seconds": pytest.approx(0.6), "calls": 3}


def test_only_the_observer_is_counted_not_the_wrapped_method(clock):
    c, acc = clock

    def original(self, x):
        c.t += 5.0  # the engine's own work
        return x + 1

    def observe(self, args, kwargs, result):
        c.t += 0.01  # the capture's
        assert result == 3

    wrapped = hooks._observe_method(original, observe, "k", "w")
    assert wrapped(None, 2) == 3
    assert acc.seconds == pytest.approx(0.01) and acc.calls == 1

    def failing(self, args, kwargs, result):
        c.t += 0.02
        raise RuntimeError("a capture problem")

    assert hooks._observe_method(original, failing, "k2", "w2")(None, 2) == 3  # the engine goes on
    assert acc.seconds == pytest.approx(0.03)


def test_a_handoff_wrapper_counts_its_observer_only(clock):
    c, acc = clock

    def talker2code2wav_full_payload(a, b=0):
        c.t += 2.0
        return {"payload": a + b}

    seen = []
    wrapped = hooks._wrap_handoff(talker2code2wav_full_payload, lambda args, result: (seen.append(args), setattr(c, "t", c.t + 0.005)))
    assert wrapped(1, b=2) == {"payload": 3}
    assert seen == [{"a": 1, "b": 2}] and acc.seconds == pytest.approx(0.005)
