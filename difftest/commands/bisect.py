"""`difftest bisect` and `difftest probe`.

    difftest bisect --repo PATH --good REV --bad REV --suite SUITE --out DIR [--recipe vllm-omni|cpu-engine]
                    [-n N] [--repeats R [--agree K]] [--bad-on VERDICTS] [--policy P] [--store DIR] ...
    git bisect run difftest probe --suite SUITE --out DIR [same options]       # 0 good, 1 bad, 125 skip

Until difftest/cli.py wires them in, both also run as `python -m difftest.bisect bisect|probe ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ..errors import BadInput, DifftestError
from ..process.placement import device_arg

PROBE_ABORT = 128  # `git bisect run` stops on it: bad input or a failure that is no commit's fault


def _kv(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default=".", help="the git repository under test (default: the current folder)")
    p.add_argument("--suite", required=True, help="suite YAML file")
    p.add_argument("--out", required=True, help="state (bisect.json / probes.json), probe runs, logs; "
                                                "run again with the same --out to resume")
    p.add_argument("--builds", help="a cache root of its own for the per-commit worktrees and environments "
                                    "(default: difftest's cache, $DIFFTEST_CACHE or .cache/difftest; "
                                    "see `difftest cache list`)")
    g = p.add_argument_group("how a commit becomes a candidate")
    g.add_argument("--recipe", default="vllm-omni",
                   help="vllm-omni: a vLLM-Omni source checkout served by `vllm serve --omni`; cpu-engine: the CPU "
                        "test engine (not vLLM-Omni) planting the defect the checked-out package declares")
    g.add_argument("--base-python", help="the shared base environment's interpreter; each commit's venv overlays it "
                                         "(default: .venv-vllm-omni for vllm-omni, .venv-reference for cpu-engine)")
    g.add_argument("--module", help="the package each commit installs, checked to import from its worktree "
                                    "(default vllm_omni; cpu-engine: the --declared-by module)")
    g.add_argument("--pip-args", help="pip install arguments before `-e WORKTREE` (default: "
                                      "'--no-deps --no-build-isolation --config-settings editable_mode=compat')")
    g.add_argument("--declared-by", default="fakeomni:planted_defect", metavar="MODULE:FUNCTION",
                   help="cpu-engine: called in the commit's environment before each run; answers the defect to "
                        "plant or None (default fakeomni:planted_defect)")
    g.add_argument("--cpu-engine-arg", action="append", default=[], metavar="ARG",
                   help="cpu-engine: one more argument for runners.cpu_engine (repeatable)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="[STAGE.]KEY=VALUE",
                   help="vllm-omni: one deploy setting for every commit, as `difftest run --engine-arg`")
    g.add_argument("--omni-device", choices=("cuda", "cpu"), default="cuda", help="vllm-omni: where it serves")
    g.add_argument("--omni-option", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                   help="vllm-omni: a VllmOmniOptions field (VALUE as JSON), e.g. accept_length_finish=true")
    r = p.add_argument_group("each run (as `difftest run`)")
    r.add_argument("--concurrency", "-n", type=int, default=4)
    r.add_argument("--pattern", default="barrier", choices=("barrier", "pool", "staggered"))
    r.add_argument("--order", default="suite", choices=("suite", "permuted", "mixed", "long-first"))
    r.add_argument("--voices", default="inline", choices=("inline", "registered"))
    r.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"),
                   help="reference result store (default ./difftest-store or $DIFFTEST_STORE)")
    r.add_argument("--policy", help="policy YAML (default: the built-in one)")
    r.add_argument("--reference-model", action="append", default=[])
    r.add_argument("--reference-python")
    r.add_argument("--reference-device", "--device", dest="device", type=device_arg, default="cpu",
                   metavar="cpu|cuda|cuda:N", help="reference runner device (cuda:N: the host's GPU N)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="reference runner dtype")
    d = p.add_argument_group("deciding")
    d.add_argument("--repeats", type=int, default=1, help="runs per commit at most (flaky candidates), default 1")
    d.add_argument("--agree", type=int, help="alike runs that decide a commit (default: a majority of --repeats); "
                                             "fewer alike: the commit is skipped")
    d.add_argument("--bad-on", help="comma-separated verdicts that make a run bad (default: the policy's fail_on); "
                                    "e.g. contamination, to chase one regression past unrelated ones")
    m = p.add_argument_group("MLflow")
    m.add_argument("--tracking-uri", help="default $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db")
    m.add_argument("--experiment", help="default difftest/bisect/<suite name>")
    m.add_argument("--no-mlflow", action="store_true", help="record nothing in MLflow")


def _setup(args):
    """(prober, identity, suite, tracking) from the arguments."""
    from ..bisect.builds import DEFAULT_PIP_ARGS, RECIPES
    from ..bisect.probe import Prober, ProbeSettings
    from ..bisect.session import Tracking
    from ..engines.reference import ReferenceOptions
    from ..run import RunOptions
    from ..suites.suite import load_suite
    from ..verdicts.policy import VERDICTS, load_policy

    suite = load_suite(args.suite)
    policy = load_policy(args.policy)
    if args.concurrency < 1:
        raise BadInput("--concurrency must be at least 1")
    bad_on = None
    if args.bad_on:
        bad_on = frozenset(v.strip() for v in args.bad_on.split(",") if v.strip())
        unknown = bad_on - set(VERDICTS)
        if unknown:
            raise BadInput(f"--bad-on: unknown verdict(s) {', '.join(sorted(unknown))} (known: {', '.join(VERDICTS)})")
    opts = RunOptions(concurrency=args.concurrency, pattern=args.pattern, order=args.order, voice_mode=args.voices,
                      store=Path(args.store),
                      reference=ReferenceOptions(models=args.reference_model, python=args.reference_python,
                                                 device=args.device, dtype=args.dtype))
    settings = ProbeSettings(suite, policy, opts, repeats=args.repeats, agree=args.agree, bad_on=bad_on)
    pip_args = shlex.split(args.pip_args) if args.pip_args is not None else DEFAULT_PIP_ARGS
    if args.recipe not in RECIPES:  # checked here, not by argparse: the recipes' module is slow to import
        raise BadInput(f"--recipe {args.recipe!r}: no such recipe (known: {', '.join(RECIPES)})")
    recipe = RECIPES[args.recipe].from_args(args, pip_args)
    out = Path(args.out)
    builds = Path(args.builds) if args.builds else None
    prober = Prober(args.repo, recipe, settings, builds, out)
    identity = {"recipe": recipe.identity(), **settings.identity()}
    tracking = Tracking(args.tracking_uri, args.experiment, not args.no_mlflow)
    return prober, identity, suite, tracking


def cmd_bisect(args) -> int:
    from ..bisect.session import run_bisect

    if args.workers < 1:
        raise BadInput("--workers must be at least 1")
    prober, identity, suite, tracking = _setup(args)
    if args.workers > 1:  # each probe its own `difftest probe` process (difftest.bisect.parallel)
        from ..bisect.parallel import ProcessProber, common_argv

        prober = ProcessProber(common_argv(args, add_probe_parser(argparse.ArgumentParser().add_subparsers())),
                               args.out)
        return run_bisect(args.repo, args.good, args.bad, prober, args.out, identity=identity, suite_name=suite.name,
                          tracking=tracking, workers=args.workers)
    with prober:
        return run_bisect(args.repo, args.good, args.bad, prober, args.out, identity=identity, suite_name=suite.name,
                          tracking=tracking)


def cmd_probe(args) -> int:
    """git's exit codes, whatever happens: 0 good, 1 bad, 125 skip, 128 abort."""
    from ..bisect.session import run_probe

    try:
        prober, identity, suite, tracking = _setup(args)
        with prober:
            return run_probe(args.repo, args.rev, prober, args.out, identity=identity, suite_name=suite.name,
                             tracking=tracking)
    except DifftestError as e:
        print(f"difftest probe: error (aborting the bisect): {e}", file=sys.stderr)
        return PROBE_ABORT
    except KeyboardInterrupt:
        print("difftest probe: interrupted (aborting the bisect)", file=sys.stderr)
        return PROBE_ABORT


def add_bisect_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bisect", help="find the first commit of a repository whose candidate fails the suite",
        description="Checks that --good passes and --bad fails, then bisects the first-parent line between them: "
                    "each probe builds the commit (git worktree + editable install over a base environment, cached), "
                    "serves it and runs the suite against the cached reference. Exit 0: the first bad commit is "
                    "named; 2: the ends do not behave as stated; 3: skipped commits leave it ambiguous.")
    p.add_argument("--good", required=True, help="a commit whose candidate passes")
    p.add_argument("--bad", required=True, help="a later commit whose candidate fails")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="probe up to K commits per round side by side, each in its own `difftest probe` process "
                        "(a (K+1)-ary search: fewer rounds, more probes); default 1, the binary search")
    _common(p)
    p.set_defaults(func=cmd_bisect)
    return p


def add_probe_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="decide one commit for `git bisect run`: exit 0 good, 1 bad, 125 skip, 128 abort",
        description="Builds, serves and runs the suite on one commit (default HEAD, what git bisect checked out) "
                    "and answers in git bisect run's exit codes: 0 good, 1 bad, 125 skip (does not install, server "
                    "does not start, runs disagree), 128 abort (bad input; a failure that is no commit's fault).")
    p.add_argument("--rev", default="HEAD", help="the commit to probe (default HEAD)")
    _common(p)
    p.set_defaults(func=cmd_probe)

    def error(message, _p=p):  # a usage error must abort git bisect run, not read as "bad"
        _p.print_usage(sys.stderr)
        print(f"difftest probe: error: {message}", file=sys.stderr)
        sys.exit(PROBE_ABORT)

    p.error = error
    return p
