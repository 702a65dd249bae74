"""The reference runner's `decode` item `dtype`: qwen-tts's vocoder in another dtype than the runner's
own (the vocoder's measured null, difftest/verdicts/vocoder_null.py), on the tiny checkpoint with the
real qwen-tts."""

from __future__ import annotations

import numpy as np
from reference_support import start_runner, tiny  # noqa: F401

from difftest.compare.audio import snr_db
from difftest.results import read_result


def test_a_decode_item_runs_qwen_tts_vocoder_in_its_dtype(tiny, tmp_path):  # noqa: F811
    rng = np.random.default_rng(0)
    src = tmp_path / "codes.npz"
    np.savez(src, codes=rng.integers(0, 2048, (30, 16)), ref_codes=rng.integers(0, 2048, (12, 16)))
    item = lambda name, **kw: {"name": name, "input": str(src), "out": str(tmp_path / name), **kw}  # noqa: E731
    items = [item("own"), item("bf16", dtype="bfloat16"), item("bf16-again", dtype="bfloat16"),
             item("fp32", dtype="float32"), item("fp16", dtype="float16")]
    runner = start_runner([str(tiny / "base")], log_path=tmp_path / "runner.log")
    try:
        assert runner.hello["decode_dtypes"] == ["float32", "bfloat16"]
        events = [e for e in runner.request("decode", timeout=300, items=items)
                  if e.get("event") in ("result", "error")]
    finally:
        runner.close()
    got = {e["item"]: e for e in events}
    assert got["fp16"]["event"] == "error" and got["fp16"]["kind"] == "bad_input"
    assert got["fp16"]["message"] == "dtype 'float16': expected one of float32, bfloat16"
    r = {k: read_result(got[k]["path"]) for k in ("own", "bf16", "bf16-again", "fp32")}
    assert [r[k].provenance["dtype"] for k in r] == ["float32", "bfloat16", "bfloat16", "float32"]
    own, bf16 = r["own"].wav, r["bf16"].wav
    assert np.array_equal(r["fp32"].wav, own)  # the runner's own dtype asked by name: the same decoder
    assert np.array_equal(r["bf16-again"].wav, bf16)  # the bf16 copy decodes deterministically
    assert len(bf16) == len(own) and abs(len(own) - 30 * 1920) <= 1
    assert not np.array_equal(bf16, own)
    # bf16 rounding, not another decode: the same waveform under noise (17 dB here on real codes)
    snr = float(snr_db(np.sum(own.astype(np.float64) ** 2), np.sum((own - bf16).astype(np.float64) ** 2)))
    print(f"bf16 against float32: {snr:.1f} dB")
    assert 6.0 < snr < 60.0, snr
    assert np.corrcoef(own, bf16)[0, 1] > 0.8
