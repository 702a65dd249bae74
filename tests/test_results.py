"""Result artifacts and the store: round trip, atomicity, and nothing corrupt is ever trusted."""

import io
import json
import logging

import numpy as np
import pytest

from difftest.results import CorruptResult, Result, ResultStore, load_result_set, read_result, write_result


def _result(sid="s1", h="a" * 64, n=3):
    rng = np.random.default_rng(0)
    return Result(segment_id=sid, segment_hash=h, wav=rng.standard_normal(n * 1920).astype(np.float32),
                  sample_rate=24000, codes=rng.integers(0, 2048, (n, 16)), ref_codes=np.zeros((0, 16), int),
                  provenance={"engine": "x"}, timings={"seconds": 1.5}, meta={"runner": "toy", "concurrency": 1},
                  extra={"vocoder_input": rng.integers(0, 2048, (n + 2, 16))})


def test_roundtrip(tmp_path):
    r = _result()
    side = write_result(tmp_path / "s1.aaaa", r)
    back = read_result(side)
    assert np.array_equal(back.wav, r.wav) and back.wav.dtype == np.float32
    assert np.array_equal(back.codes, r.codes) and back.codes.dtype == np.int64
    assert back.ref_codes.shape == (0, 16)
    assert np.array_equal(back.extra["vocoder_input"], r.extra["vocoder_input"])
    assert (back.provenance, back.timings, back.meta) == (r.provenance, r.timings, r.meta)
    assert back.has_codes and not back.quantised
    meta = json.loads(side.read_text())
    assert meta["shapes"]["codes"] == [3, 16] and meta["format"] == "difftest.result/1"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


def test_npz_holds_no_pickles(tmp_path):
    write_result(tmp_path / "s", _result())
    with np.load(tmp_path / "s.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["codes", "ref_codes", "vocoder_input", "wav"]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"codes must have shape \(T, 16\)"):
        Result("s", "h", np.zeros(10), 24000, codes=np.zeros((3, 8), int))
    with pytest.raises(ValueError, match="must hold integers"):
        Result("s", "h", np.zeros(10), 24000, codes=np.zeros((3, 16), float))


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "s.npz").write_bytes((d / "s.npz").read_bytes()[:-100]), "does not match its sidecar's sha256"),
    (lambda d: (d / "s.npz").unlink(), "missing (sidecar present)"),
    (lambda d: (d / "s.json").write_text("{\"format\": "), "not valid JSON"),
    (lambda d: (d / "s.json").write_text("{}"), "not a difftest.result/1 sidecar"),
])
def test_corrupt_files_are_detected(tmp_path, damage, message):
    write_result(tmp_path / "s", _result())
    damage(tmp_path)
    with pytest.raises(CorruptResult) as e:
        read_result(tmp_path / "s.json")
    assert message in str(e.value)


def test_pickled_array_is_refused(tmp_path):
    write_result(tmp_path / "s", _result())
    side = json.loads((tmp_path / "s.json").read_text())
    buf = io.BytesIO()
    np.savez(buf, codes=np.zeros((1, 16), int), ref_codes=np.zeros((0, 16), int),
             wav=np.array([{"evil": 1}], dtype=object))
    (tmp_path / "s.npz").write_bytes(buf.getvalue())
    import hashlib
    side["npz_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (tmp_path / "s.json").write_text(json.dumps(side))
    with pytest.raises(CorruptResult, match="member wav.npy holds Python objects"):
        read_result(tmp_path / "s.json")


def test_store_keys_and_corrupt_entry_is_missing(tmp_path, caplog):
    store = ResultStore(tmp_path)
    fp = {"engine": "qwen-tts", "version": "0.1.1", "checkpoint_sha256": "c" * 64}
    d = store.config_dir("qwen-tts", fp)
    assert d == store.config_dir("qwen-tts", dict(reversed(list(fp.items()))))  # key is order-free
    assert d != store.config_dir("qwen-tts", {**fp, "dtype": "bfloat16"})
    assert json.loads((d / "config.json").read_text())["fingerprint"] == fp
    r = _result(h="b" * 64)
    assert store.get(d, "s1", "b" * 64) is None
    store.put(d, r)
    assert np.array_equal(store.get(d, "s1", "b" * 64).wav, r.wav)
    assert store.get(d, "s1", "c" * 64) is None  # other content, other key
    npz = next(d.glob("s1.*.npz"))
    npz.write_bytes(npz.read_bytes()[:50])
    with caplog.at_level(logging.WARNING):
        assert store.get(d, "s1", "b" * 64) is None
    assert "treating as missing" in caplog.text


def test_load_result_set_skips_corrupt_with_warning(tmp_path):
    write_result(tmp_path / "a", _result("a"))
    write_result(tmp_path / "b", _result("b"))
    (tmp_path / "b.npz").write_bytes(b"junk")
    (tmp_path / "report.json").write_text("{}")
    results, warnings = load_result_set(tmp_path)
    assert list(results) == ["a"]
    assert len(warnings) == 1 and "b.npz" in warnings[0]


def test_a_result_is_reused_only_with_its_whole_wave():
    """A wave-mate missing (changed, so another hash, or never finished) takes the rest of its wave
    with it, through every peer of a peer; a result without a recorded wave stands alone."""
    from difftest.results import reusable_together

    def r(sid, **meta):
        return Result(sid, "h", np.zeros(4, np.float32), 24000, meta=meta)

    found = {"a": r("a", wave=["a", "b"]), "c": r("c", wave=["c", "d"]), "d": r("d", wave=["c", "d"]),
             "e": r("e", batch=["e", "f"]), "f": r("f", batch=["f", "e"]), "g": r("g"),
             "x": r("x", wave=["x", "y"]), "y": r("y", wave=["y", "a"])}
    assert sorted(reusable_together(found)) == ["c", "d", "e", "f", "g"]
    assert sorted(reusable_together({k: v for k, v in found.items() if k != "e"})) == ["c", "d", "g"]
