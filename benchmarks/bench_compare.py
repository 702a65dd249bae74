"""Comparison throughput, in multiples of real time on one core.

    python benchmarks/bench_compare.py [--minutes 30] [--segment-seconds 10]

Synthetic 24 kHz audio with codes (no engine needed). Measures (1) one audio
comparison with the full per-chunk metric set (max |diff|, RMS, SNR, log-mel)
plus the code diff, (2) the whole classifier with all four comparisons of
the matrix (headline, concurrency, vocoder, donor search with two peers) on
float drift (1e-5 noise: "close"), and (3) the same classifier on the common
case: half the segments bit-identical everywhere, half quantisation-level (the
candidate at N and at 1 the same 16-bit PCM audio against the float reference,
quantised=True). Each compared role's audio is its own array there, as when
read from disk. Prints one JSON object.
"""

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from difftest.compare.align import chunk_frame_bounds  # noqa: E402
from difftest.compare.audio import frame_metrics, reduce_frames  # noqa: E402
from difftest.compare.codes import diff_codes  # noqa: E402
from difftest.results import Result  # noqa: E402
from difftest.verdicts.classify import Evidence, classify  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--segment-seconds", type=float, default=10.0)
    a = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = np.random.default_rng(0)
    frames = int(a.segment_seconds * 12.5)
    n_seg = int(round(a.minutes * 60 / a.segment_seconds))
    segs = []
    for i in range(n_seg):
        codes = rng.integers(0, 2048, (frames, 16))
        ref = rng.integers(0, 2048, (30, 16))
        wav = (0.3 * rng.standard_normal(frames * 1920)).astype(np.float32)
        drift = wav + (1e-5 * rng.standard_normal(len(wav))).astype(np.float32)
        segs.append((codes, ref, wav, drift))
    audio_s = n_seg * frames * 1920 / 24000

    t0 = time.process_time()
    for codes, ref, wav, drift in segs:
        fm = frame_metrics(wav, drift)
        reduce_frames(fm, chunk_frame_bounds(len(fm.max_abs)))
        diff_codes(codes, codes)
    one = time.process_time() - t0

    policy = load_policy()
    mk = lambda sid, c, r, w: Result(sid, "h" * 64, w, 24000, codes=c, ref_codes=r)  # noqa: E731
    t0 = time.process_time()
    verdicts = {}
    for i, (codes, ref, wav, drift) in enumerate(segs):
        ev = Evidence(segment_id=f"s{i}", reference=mk("r", codes, ref, wav), candidate=mk("c", codes, ref, drift),
                      control=mk("k", codes, ref, drift),
                      cross_own=mk("x", codes, ref, wav),
                      cross_donors={"p1": mk("p1", codes, ref, wav), "p2": mk("p2", codes, ref, wav)},
                      peer_ref_codes={"p1": ref[:5], "p2": ref[:7]})
        v = classify(ev, policy)
        verdicts[v.verdict] = verdicts.get(v.verdict, 0) + 1
    full = time.process_time() - t0

    def pcm16(w):  # a WAV's round trip: 32767 in, 32768 out (libsndfile)
        return (np.rint(w.astype(np.float64) * 32767) / 32768).astype(np.float32)

    def mkq(sid, c, r, w, q=False):
        return Result(sid, "h" * 64, w.copy(), 24000, codes=c, ref_codes=r, quantised=q)

    common_evs = []
    for i, (codes, ref, wav, _) in enumerate(segs):
        wav = 0.5 * wav  # peaks about 0.75: nothing that 16-bit PCM would clip
        quant = i % 2 == 1
        cw = pcm16(wav) if quant else wav
        r = mkq("r", codes, ref, wav)
        common_evs.append(Evidence(  # the peers are never compared here (no bad chunk): the reference's array
            segment_id=f"s{i}", reference=r, candidate=mkq("c", codes, ref, cw, quant),
            control=mkq("k", codes, ref, cw, quant),
            cross_own=mkq("x", codes, ref, wav),
            cross_donors={"p1": mk("p1", codes, ref, r.wav), "p2": mk("p2", codes, ref, r.wav)},
            peer_ref_codes={"p1": ref[:5], "p2": ref[:7]}))
    t0 = time.process_time()
    common_verdicts = {}
    for ev in common_evs:
        v = classify(ev, policy)
        common_verdicts[v.verdict] = common_verdicts.get(v.verdict, 0) + 1
    common = time.process_time() - t0
    print(json.dumps({
        "audio_seconds": audio_s, "segments": n_seg, "segment_seconds": a.segment_seconds,
        "one_comparison_cpu_s": round(one, 3), "one_comparison_x_realtime": round(audio_s / one, 1),
        "full_matrix_cpu_s": round(full, 3), "full_matrix_x_realtime": round(audio_s / full, 1),
        "verdicts": verdicts, "target_x_realtime": 1000,
        "common_case_cpu_s": round(common, 3), "common_case_x_realtime": round(audio_s / common, 1),
        "common_case_verdicts": common_verdicts, "common_case_target_x_realtime": 5000,
    }, indent=1))


if __name__ == "__main__":
    main()
