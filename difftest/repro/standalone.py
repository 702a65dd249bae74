#!/usr/bin/env python3
"""Reproduce one difftest finding against a speech server, with nothing but Python's standard library.

    python3 repro.py --url http://127.0.0.1:8091

This file is copied as is into each bundle `difftest repro` writes (beside bundle.json, the
voices and the expected audio); it never imports difftest. It sends the bundle's requests to
vLLM-Omni's API (each request's `path`: POST /v1/audio/speech for Qwen3-TTS, /v1/chat/completions
with audio output for Qwen3-Omni, whose answer carries the WAV in base64) in the arrival the finding needs (waves released
together for a concurrency finding, one at a time otherwise), compares the audio with the expected
audio chunk by chunk (every request's for a concurrency finding, the target's otherwise) (the chunks vLLM-Omni decodes: 1 frame, then 25 frames of
80 ms), prints where it differs, and exits

    1  the defect shows: a chunk differs beyond the tolerance below, or the length differs
    0  it does not
    2  the server could not be asked (unreachable, an HTTP error, not a WAV)

A finding that needs concurrency shows only when its requests share a batch, which depends on
when they arrive: the requests are sent up to three times (`--tries N`), stopping at the first
time the defect shows; the exit is 0 only when none did.

Tolerance: a chunk differs when its largest sample difference exceeds `close_max_abs` and its
signal-to-difference ratio is below `close_snr_db` (bundle.json; difftest's policy, which measured
them). The expected audio is the candidate's own answer at concurrency 1 for a finding that needs
concurrency, the reference's for one that does not (bundle.json `against`).
"""

import argparse
import base64
import json
import math
import os
import struct
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def read_wav(data):
    """(samples as floats in [-1, 1), sample rate) of a mono 16-bit PCM or 32-bit float WAV."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if size in (0, 0xFFFFFFFF):
                body = data[pos + 8:]
            if fmt is None or fmt[1] != 1:
                raise ValueError("not a mono WAV")
            tag, _, rate, bits = fmt
            if tag == 1 and bits == 16:
                n = len(body) // 2
                return [v / 32768.0 for v in struct.unpack(f"<{n}h", body[:2 * n])], rate
            if tag == 3 and bits == 32:
                n = len(body) // 4
                return list(struct.unpack(f"<{n}f", body[:4 * n])), rate
            raise ValueError(f"unsupported WAV format (tag {tag}, {bits} bits)")
        pos += 8 + size + (size & 1)
    raise ValueError("no data chunk")


def speak(url, item, data, timeout):
    """The answer's WAV bytes: the body itself, or a chat completion's audio (base64 in its JSON)."""
    req = urllib.request.Request(url.rstrip("/") + item.get("path", "/v1/audio/speech"), data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer = r.read()
    if item.get("answer", "wav") != "chat":
        return answer
    try:
        choices = json.loads(answer)["choices"]
        audio = next(c["message"]["audio"] for c in choices if (c.get("message") or {}).get("audio"))
        return base64.b64decode(audio["data"], validate=True)
    except (ValueError, KeyError, TypeError, StopIteration) as e:
        raise ValueError(f"no audio in the chat completion ({type(e).__name__}: {e})") from None


def request_body(item):
    body = dict(item["body"])
    if item.get("ref_audio_file"):
        with open(os.path.join(HERE, item["ref_audio_file"]), "rb") as f:
            body["ref_audio"] = "data:audio/wav;base64," + base64.b64encode(f.read()).decode()
    return body


def send_all(url, bundle, timeout):
    """request id -> WAV bytes, sent in waves of `concurrency` released together (barrier), by
    `concurrency` workers pulling (pool), or in waves whose requests start 50 ms apart (staggered)."""
    items, n = bundle["requests"], max(1, bundle["concurrency"])
    answers, errors = {}, {}

    def one(item, gate=None, delay=0.0):
        try:
            data = json.dumps(request_body(item)).encode()  # before the gate: a wave leaves together
            if gate is not None:
                gate.wait()
            time.sleep(delay)
            answers[item["id"]] = speak(url, item, data, timeout)
        except Exception as e:  # the server's answer or its absence: reported, exit 2
            errors[item["id"]] = e

    if bundle["pattern"] == "pool":
        queue, lock = list(items), threading.Lock()

        def worker():
            while True:
                with lock:
                    if not queue:
                        return
                    item = queue.pop(0)
                one(item)

        threads = [threading.Thread(target=worker) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(0, len(items), n):
            wave = items[i:i + n]
            gate = threading.Barrier(len(wave))
            stagger = 0.05 if bundle["pattern"] == "staggered" else 0.0
            threads = [threading.Thread(target=one, args=(item, gate, k * stagger)) for k, item in enumerate(wave)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return answers, errors


def chunk_bounds(n_samples, spf, initial, frames):
    n_frames = -(-n_samples // spf)
    bounds, f = [0], initial
    while f < n_frames:
        bounds.append(f)
        f += frames
    bounds.append(n_frames)
    return [min(b * spf, n_samples) for b in bounds]


def compare(got, want, bundle):
    """Per chunk: (index, first sample, max |difference|, SNR dB, differs)."""
    tol, spf = bundle["tolerance"], bundle["samples_per_frame"]
    n = min(len(got), len(want))
    bounds = chunk_bounds(n, spf, bundle["chunks"]["initial_frames"], bundle["chunks"]["frames"])
    rows = []
    for k in range(len(bounds) - 1):
        a, b = want[bounds[k]:bounds[k + 1]], got[bounds[k]:bounds[k + 1]]
        diff = [x - y for x, y in zip(b, a)]
        peak = max((abs(d) for d in diff), default=0.0)
        sig, err = sum(x * x for x in a), sum(d * d for d in diff)
        snr = 200.0 if err == 0 else (10 * math.log10(sig / err) if sig > 0 else -200.0)
        differs = peak > tol["close_max_abs"] and snr < tol["close_snr_db"]
        first = next((bounds[k] + i for i, d in enumerate(diff) if abs(d) > tol["close_max_abs"]), None)
        rows.append((k, first, peak, snr, differs))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the speech server (http://host:port)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--tries", type=int, default=None,
                   help="send the requests up to N times, stopping at the first that shows the defect (default: 3 "
                        "for a finding that needs concurrency, whose batches depend on when requests arrive; else 1)")
    p.add_argument("--bundle", default=os.path.join(HERE, "bundle.json"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tries is not None and args.tries < 1:
        p.error("--tries must be at least 1")  # exit 2: none sent, so nothing shown either way
    with open(args.bundle, encoding="utf-8") as f:
        bundle = json.load(f)
    print(f"{bundle['title']}\nsending {len(bundle['requests'])} request(s) at concurrency {bundle['concurrency']} "
          f"({bundle['pattern']}) to {args.url}")
    tries = args.tries or (3 if bundle["against"] == "own_c1" else 1)
    for k in range(1, tries + 1):
        if tries > 1:
            print(f"try {k} of {tries}")
        code = one_try(args, bundle)
        if code != 0:
            return code
    return 0


def one_try(args, bundle):
    """Send every request once and compare: 1 the defect shows, 0 it does not, 2 no audio."""
    target = bundle["target"]
    answers, errors = send_all(args.url, bundle, args.timeout)
    if errors:
        for rid, e in sorted(errors.items()):
            print(f"  {rid}: no audio: {e}")
        return 2
    spf = bundle["samples_per_frame"]
    shows = False
    for item in bundle["requests"]:
        rid = item["id"]
        try:
            got, rate = read_wav(answers[rid])
        except ValueError as e:
            print(f"  {rid}: the answer is not audio this script reads: {e}")
            return 2
        got = got[item.get("lead_samples", 0):]  # the expected audio starts at frame 0
        with open(os.path.join(HERE, item["expected"]), "rb") as f:
            want, _ = read_wav(f.read())
        rows = compare(got, want, bundle)
        bad = [r for r in rows if r[4]]
        length_differs = len(got) != len(want)
        mark = "TARGET " if rid == target else ""
        if not bad and not length_differs:
            print(f"  {mark}{rid}: as expected ({len(got)} samples, worst chunk "
                  f"{max((r[2] for r in rows), default=0.0):.2e} max abs)")
            continue
        if length_differs:
            print(f"  {mark}{rid}: {len(got)} samples, expected {len(want)} "
                  f"({(len(got) - len(want)) / spf:+.2f} frames of 80 ms)")
        for k, first, peak, snr, _ in bad:
            frame = first // spf if first is not None else None
            print(f"  {mark}{rid}: chunk {k} differs from sample {first} (frame {frame}, {first / rate:.3f} s): "
                  f"max abs {peak:.3f}, SNR {snr:.1f} dB")
        # at concurrency, which request gives and which takes can swap with the order the engine
        # batches them in: any request of the minimal set off its own audio shows the defect
        if rid == target or bundle["against"] == "own_c1":
            shows = True
    where = "the requests" if bundle["against"] == "own_c1" else target
    print(f"the defect {'SHOWS' if shows else 'does not show'} in {where} (against {bundle['against_label']})")
    return 1 if shows else 0


if __name__ == "__main__":
    sys.exit(main())
