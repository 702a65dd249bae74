"""`difftest selfcheck`: does this tester, on this machine, catch the defects we know?

Runs a suite against the CPU test engine, clean and with each planted defect,
and checks each run's verdicts against what the defect must cause. A tester
that flags the clean engine, or lets a defect escape, is not to be trusted as
a gate. One engine process hosts every variant and one reference runner
serves every run, so the cost is the decoding, not the start-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..checkout import REPO
from ..engines.reference import ReferenceOptions, reference_python
from ..engines.start import Setup, start_cpu_engines
from ..errors import BadInput
from ..pipeline.starting import resolve_models, start_reference_runner
from ..results import atomic_write, load_result_set
from ..run import RunOptions, run
from ..suites.suite import Suite, content_hash
from ..suites.voices import reference_frames
from ..verdicts.policy import Policy
from ..verdicts.talker_input import DONOR_KIND

POWER_TOKENS = 1920  # the `power` variant's talker tokens (sampled-power's; bench_sampling_power.py measures)


@dataclass(frozen=True)
class Check:
    name: str
    defect: str | None  # None: the clean engine
    variant: str  # greedy | sampled | long | power
    expect: frozenset  # verdicts that count as catching it (empty: must pass)
    concurrency_only: bool  # must be invisible at concurrency 1
    caught_at_one: bool = False  # must fail at concurrency 1 alone as well (a talker defect acts there too)
    stage: str | None = None  # where it must be placed (None: wherever its verdict is found)


CHECKS = (
    Check("clean", None, "greedy", frozenset(), False),
    Check("clean, sampled", None, "sampled", frozenset(), False),
    Check("clean, power", None, "power", frozenset(), False),
    Check("ref-leak", "ref-leak", "greedy", frozenset({"contamination"}), True),
    Check("shared-rng", "shared-rng", "sampled", frozenset({"concurrency_defect"}), True),
    Check("batch-mixup", "batch-mixup", "greedy", frozenset({"concurrency_defect", "contamination"}), True),
    Check("chunk-boundary", "chunk-boundary", "long", frozenset({"vocoder_defect"}), False),
    Check("ref-in-output", "ref-in-output", "greedy", frozenset({"length_mismatch"}), False),
    # with the talker's side captured, the lost frame is placed in the hand-off itself
    Check("off-by-one", "off-by-one", "greedy", frozenset({"length_mismatch", "handoff_defect"}), False),
    # talker defects: the capture reports what the request asked for; teacher forcing sees the rest
    *(Check(d, d, "greedy", frozenset({"talker_defect"}), False, True)
      for d in ("sampled-greedy", "codebook-shift")),
    # the talker's input is captured (schema v3): what its prompt is made of, named field by field
    *(Check(d, d, "greedy", frozenset({"talker_defect"}), False, True, "talker_input")
      for d in ("prompt-truncated", "language-dropped", "streaming-layout", "speaker-scaled", "text-word-dropped")),
    # ...and the prompt as assembled, row by row (issue 57, item 5): every ingredient right, one row moved; or the
    # rows altered after the builder (padded; scaled, below every per-token line, which the measured null sees too)
    *(Check(d, d, "greedy", frozenset({"talker_defect"}), False, True, "talker_input")
      for d in ("prompt-row-moved", "prompt-padded")),
    Check("speaker-leak", "speaker-leak", "greedy", frozenset({"contamination"}), True, stage="talker_input"),
    # sampling tighter or hotter than asked: every token inside the support, only the run-level sampling test sees it
    # (temperature-ignored moved z to about -2.5 only; the likelihood ratio against the sampler bank catches it)
    Check("temperature-ignored", "temperature-ignored", "sampled", frozenset({"sampling_defect"}), False, True),
    Check("top-k-narrowed", "top-k-narrowed", "sampled", frozenset({"sampling_defect"}), False, True),
    Check("top-k-ignored", "top-k-ignored", "sampled", frozenset({"talker_defect"}), False, True),
    # the sampler bank's alternatives (#31): the strong ones on the sampled variant; a temperature off by 0.1 and
    # the repetition penalty dropped or doubled need the talker tokens of the `power` variant
    Check("top-k-halved", "top-k-halved", "sampled", frozenset({"sampling_defect"}), False, True),
    Check("top-p-applied", "top-p-applied", "sampled", frozenset({"sampling_defect"}), False, True),
    Check("unprocessed-logits", "unprocessed-logits", "sampled", frozenset({"talker_defect"}), False, True),
    *(Check(d, d, "power", frozenset({"sampling_defect"}), False, True)
      for d in ("talker-temperature-hot", "talker-temperature-cold", "repetition-penalty-dropped",
                "repetition-penalty-twice")),
    # below every per-token line: the whole run against the measured null shows it (#28); the assembled prompt,
    # captured in float32 (exact), shows it in every segment
    Check("prompt-embeds-scaled", "prompt-embeds-scaled", "greedy", frozenset({"talker_defect"}), False, True,
          "talker_input"),
    # a co-batched request's conditioning altered a little: its codes at N part from those at 1 on near-ties,
    # which only the null at N (qwen-tts in the engine's float32, batched as its waves, never parts) refuses to excuse;
    # the assembled prompt shows the blend itself at N (talker_defect at talker_input, right at 1)
    Check("cobatch-blend", "cobatch-blend", "greedy", frozenset({"concurrency_defect", "talker_defect"}), True),
    # a consistently wrong reference encoder: only qwen-tts's encoder of the same voice shows it
    Check("ref-audio-rate", "ref-audio-rate", "greedy", frozenset({"reference_encoder_defect"}), False, True),
)
DEFECTS = tuple(c.defect for c in CHECKS if c.defect)


def variant(suite: Suite, kind: str) -> Suite:
    """The suite as a check needs it: greedy as is; `sampled` (seeded talker sampling: the RNG
    families only show there); `long` (two segments whose decoder input crosses qwen-tts's
    300-frame chunked decode, where chunk-boundary defects live); `power` (sampled as production
    serves it, repetition penalty 1.05, each segment its own seed, long enough for POWER_TOKENS talker
    tokens in all: what the sampling test needs to see a temperature off by 0.1, cases/suites/sampled-power.yaml)."""
    if kind == "greedy":
        return suite
    segs = []
    for s in suite.segments:
        if kind == "sampled":  # each segment its own seed: the sampling test's tokens must be independent
            decode = {**s.decode, "do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 201 + len(segs)}
        elif kind == "power":
            decode = {**s.decode, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                      "repetition_penalty": 1.05, "seed": 101 + len(segs),
                      "max_new_tokens": -(-POWER_TOKENS // len(suite.segments)) + 1}
        elif kind == "long":
            if len(segs) == 2 or s.voice is None:
                continue
            ref_frames = reference_frames(s.voice.n_samples, s.voice.sample_rate)  # at 24 kHz, as encoded
            decode = {**s.decode, "max_new_tokens": max(s.decode["max_new_tokens"], 312 - ref_frames)}
        else:
            raise ValueError(kind)
        seg = replace(s, decode=decode)
        segs.append(replace(seg, hash=content_hash(seg.fingerprint())))
    return replace(suite, name=f"{suite.name}-{kind}", segments=segs,
                   hash=content_hash({"base": suite.hash, "variant": kind}))


def _leak_truth(out: Path, n: int) -> dict[tuple[str, str], list[str]]:
    """(segment, donor kind) -> whose reference codes ("codes") or generated codes ("generated") each
    request's vocoder really got at N, or whose talker input field (verdicts/talker_input's kinds) its
    talker got, from the capture files (the segments whose own they are at 1)."""
    at_n, _ = load_result_set(out / "results" / f"candidate-c{n}")
    at_1, _ = load_result_set(out / "results" / "candidate-c1")
    def value(r, name):
        return getattr(r, name) if name in ("ref_codes", "codes") else r.extra.get(name)

    kinds = (("codes", "ref_codes"), ("generated", "codes"), *((k, f) for f, k in DONOR_KIND.items()))
    truth = {}
    for sid, r in at_n.items():
        if not r.has_codes:
            continue
        for kind, field_name in kinds:
            mine = value(r, field_name)
            if mine is None or not np.size(mine):
                continue
            owners = [o for o, c in at_1.items() if c.has_codes and (v := value(c, field_name)) is not None
                      and np.shape(v) == np.shape(mine) and np.array_equal(v, mine)]
            if sid not in owners:
                truth[(sid, kind)] = owners
    return truth


def judge(check: Check, report: dict, out: Path) -> dict:
    segs = report["segments"]
    # run-level findings (the sampling test, the measured null) name no segment
    run_level = [f["verdict"] for f in (report.get("sampling"), report.get("measured_null"), report.get("measured_null_at_n"))
                 if f and f["verdict"] != "pass"]
    verdicts = sorted({s["verdict"] for s in segs} | set(run_level))
    at_one = report.get("at_concurrency_1", {}).get("verdict")
    hits = [s for s in segs if s["verdict"] in check.expect]
    hits += [{"id": "(run)", "verdict": v, "first_divergent_chunk": None, "stage": "talker", "donor": None}
             for v in run_level if v in check.expect]
    row = {"check": check.name, "defect": check.defect, "verdict": report["verdict"], "verdicts": verdicts,
           "at_concurrency_1": at_one, "chunk": None, "stage": None, "donor": None, "donor_right": None}
    if hits:
        first = min(hits, key=lambda s: (s["first_divergent_chunk"] is None, s["first_divergent_chunk"] or 0))
        row.update(chunk=first["first_divergent_chunk"], stage=first["stage"])
    if check.defect is None:
        row["ok"] = report["verdict"] == "pass" and at_one == "pass"
        row["problem"] = None if row["ok"] else "the clean engine was flagged"
        return row
    caught = report["verdict"] == "fail" and bool(hits)
    if check.concurrency_only:
        at_one_ok = at_one == "pass"
    elif check.caught_at_one:
        at_one_ok = at_one == "fail"
    else:
        at_one_ok = True  # visible at 1 as well; nothing to require
    placed = check.stage is None or any(s["stage"] == check.stage for s in hits)
    row["ok"] = caught and at_one_ok and placed
    row["problem"] = (None if row["ok"] else "escaped" if not caught
                      else ("escaped at concurrency 1, where it acts too" if check.caught_at_one
                            else "flagged at concurrency 1, where it cannot act") if not at_one_ok
                      else f"caught, but not at stage {check.stage}")
    donors = [s for s in hits if s["donor"]]
    if donors:
        truth = _leak_truth(out, report["concurrency"])
        row["donor"] = donors[0]["donor"]
        row["donor_right"] = all(s["donor"] in truth.get((s["id"], s.get("donor_kind") or "codes"), [])
                                 for s in donors)
        if not row["donor_right"]:
            row["ok"], row["problem"] = False, "wrong donor named"
    return row


def selfcheck(suite: Suite, out: Path, policy: Policy, opts: RunOptions, checks=CHECKS,
              stream=sys.stderr) -> list[dict]:
    out = Path(out)
    python = reference_python(opts.reference.python)
    models = resolve_models(suite, opts, python)
    ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})
    rows = []
    with ExitStack() as stack:
        setup = Setup(out.resolve(), models, python, suite, opts)
        specs = start_cpu_engines([c.defect for c in checks], setup, stack)
        runner = start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log",
                                               suite.family)
        stack.callback(runner.close)
        for check in checks:
            print(f"== selfcheck: {check.name} ({check.variant}, concurrency {opts.concurrency})", file=stream)
            run_dir = out / check.name.replace(", ", "-")
            report = run(variant(suite, check.variant), specs[check.defect], run_dir, policy, opts, runner=runner)
            rows.append({**judge(check, report, run_dir), "report": str(run_dir / "report.json")})
    atomic_write(out / "selfcheck.json", (json.dumps({"suite": suite.name, "concurrency": opts.concurrency,
                                                        "checks": rows}, indent=1) + "\n").encode())
    return rows


def table(rows: list[dict]) -> str:
    head = ("check", "caught", "verdicts", "at c=1", "chunk", "stage", "donor")
    lines = []
    for r in rows:
        if r["defect"] is None:
            caught = "clean: ok" if r["ok"] else "FLAGGED"
        else:
            caught = "yes" if r["ok"] else f"NO ({r['problem']})"
        donor = "" if r["donor"] is None else f"{r['donor']} ({'right' if r['donor_right'] else 'WRONG'})"
        lines.append((r["check"], caught, ",".join(r["verdicts"]), r["at_concurrency_1"] or "",
                      "" if r["chunk"] is None else str(r["chunk"]), r["stage"] or "", donor))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*x).rstrip() for x in [head, *lines])


def cmd_selfcheck(args) -> int:
    from ..suites.suite import load_suite
    from ..verdicts.policy import load_policy

    suite = load_suite(args.suite)
    policy = load_policy(args.policy)
    wanted = set(DEFECTS) if args.defects == "all" else {d.strip() for d in args.defects.split(",") if d.strip()}
    unknown = wanted - set(DEFECTS)
    if unknown:
        raise BadInput(f"--defects: unknown {', '.join(sorted(unknown))} (known: {', '.join(DEFECTS)})")
    checks = [c for c in CHECKS if c.defect is None or c.defect in wanted]
    for kind in ("sampled", "power"):  # a clean variant runs only beside a defect that needs it
        if not any(c.variant == kind and c.defect for c in checks):
            checks = [c for c in checks if not (c.defect is None and c.variant == kind)]
    opts = RunOptions(concurrency=args.concurrency, store=Path(args.store),
                      reference=ReferenceOptions(python=args.reference_python))
    rows = selfcheck(suite, Path(args.out), policy, opts, checks)
    print(table(rows))
    bad = [r["check"] for r in rows if not r["ok"]]
    print(f"selfcheck: {'FAILED: ' + ', '.join(bad) if bad else 'every planted defect caught, clean engine clean'}"
          f" ({Path(args.out) / 'selfcheck.json'})")
    return 1 if bad else 0


def add_selfcheck_parser(subparsers) -> argparse.ArgumentParser:
    sc = subparsers.add_parser("selfcheck", help="catch every planted defect of the CPU test engine, and flag "
                                                 "nothing on the clean one, before trusting a gate on this machine")
    sc.add_argument("--suite", default=str(REPO / "cases" / "suites" / "smoke.yaml"),
                    help="the suite to run each engine on (default: the smoke suite)")
    sc.add_argument("--defects", default="all", help="comma-separated defects to plant (default all); "
                                                     "the clean engine always runs")
    sc.add_argument("--concurrency", "-n", type=int, default=4, help="requests in flight at once (default 4)")
    sc.add_argument("--out", required=True, help="folder for each check's run and selfcheck.json")
    sc.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"),
                    help="reference result store (default ./difftest-store or $DIFFTEST_STORE)")
    sc.add_argument("--policy", help="policy YAML (default: the built-in one)")
    sc.add_argument("--reference-python", help="the reference environment's interpreter")
    sc.set_defaults(func=cmd_selfcheck)
    return sc
