"""difftest: does vLLM-Omni serving Qwen3-TTS at concurrency N say what qwen-tts says at 1?

Exit codes (contract 7, docs/architecture.md): 0 pass, 1 a divergence the policy calls a failure,
2 bad input or usage, 3 infrastructure failure."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
import traceback

from . import __version__
from .errors import EXIT_BAD_INPUT, EXIT_INFRA, DifftestError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors are bad input: exit 2, as argparse does, with our wording
        self.print_usage(sys.stderr)
        print(f"difftest: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


# Every subcommand: a module's add_*_parser(subparsers), which sets its handler (func). Imported
# when the parser is built; the heavy imports (MLflow, torch-free engines' clients) stay inside the handlers.
SUBCOMMANDS = (
    ("difftest.commands.run", "add_run_parser"),
    ("difftest.commands.matrix", "add_matrix_parser"),
    ("difftest.commands.compare", "add_compare_parser"),
    ("difftest.commands.reference", "add_reference_parser"),
    ("difftest.commands.handoff", "add_handoff_parser"),
    ("difftest.commands.bisect", "add_bisect_parser"),
    ("difftest.commands.bisect", "add_probe_parser"),
    ("difftest.commands.bugs", "add_bugs_parser"),
    ("difftest.commands.repro", "add_repro_parser"),
    ("difftest.commands.selfcheck", "add_selfcheck_parser"),
    ("difftest.commands.gate", "add_gate_parser"),
    ("difftest.commands.log", "add_log_parser"),
    ("dashboards.cli", "add_dashboard_parser"),  # the dashboard is its own part; only its parser is here
    ("difftest.commands.validate", "add_validate_parser"),
    ("difftest.commands.cache", "add_cache_parser"),
)
# The subcommands that load suite files (themselves or in the processes they start): --allow-root.
SUITE_COMMANDS = ("run", "matrix", "reference", "bisect", "probe", "repro", "selfcheck", "validate")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="difftest", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"difftest {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module, function in SUBCOMMANDS:
        getattr(importlib.import_module(module), function)(sub)
    from .suites.suite import ALLOW_ROOTS_ENV, allow_root_arg

    for name in SUITE_COMMANDS:
        sub.choices[name].add_argument(
            "--allow-root", action="append", default=[], type=allow_root_arg, metavar="DIR",
            help=f"a folder outside the suite's own whose voices and transcripts the suite may name, repeatable "
                 f"(also ${ALLOW_ROOTS_ENV}; by default only the suite's folder and the shipped cases/voices)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)  # usage errors: exit 2 (Parser.error)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="difftest: %(levelname)s: %(message)s")
    from .suites.suite import allowing

    with allowing(getattr(args, "allow_root", None)):  # in the environment: the processes it starts load suites too
        return dispatch(args.func, args, verbose=args.verbose)


@contextlib.contextmanager
def _signals_interrupt(caught_signal: list):
    """SIGTERM and SIGHUP act as Ctrl-C: the command unwinds, stopping every engine and runner it
    started, and keeps what it finished. Further signals while it unwinds are ignored (the unwinding
    is bounded: a server gets 15 s, a runner is killed). The signal's name is also put in
    `caught_signal`: where the KeyboardInterrupt lands in code that swallows it (a garbage
    collector's callback inside SQLAlchemy, while MLflow logs) the command still ends as interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def interrupt(signum, _frame):
        for s in caught:
            signal.signal(s, signal.SIG_IGN)
        caught_signal.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, interrupt) for s in caught}
    try:
        yield
    finally:
        if not caught_signal:  # once interrupted, stay deaf until exit: a second Ctrl-C in the interpreter's
            for s, h in old.items():  # shutdown (MLflow's exit handlers) would end it with 130 and no word
                signal.signal(s, h)


def _interrupted(why: str) -> int:
    print(f"difftest: interrupted ({why}); engines and runners it started are stopped, finished results kept",
          file=sys.stderr)
    return EXIT_INFRA


# OS errors about a path the user named (it is missing, a file, read-only) are bad input; others
# (a full disk, too many open files) are the machine's.
_USER_PATH_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                     errno.EEXIST, errno.ENAMETOOLONG}


def dispatch(func, args, verbose: bool = False) -> int:
    """Run a subcommand with the exit-code contract: 0 pass, 1 a judged divergence, 2 bad input,
    3 infrastructure. No traceback reaches the user: an unexpected exception is difftest's own bug,
    reported in one line (exit 3) with the traceback written to a file."""
    caught: list = []
    with _signals_interrupt(caught):
        try:
            code = func(args)
            return _interrupted(caught[0]) if caught else code  # swallowed on the way: still an interrupt
        except DifftestError as e:
            print(f"difftest: error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt as e:
            return _interrupted(e.args[0] if e.args else "SIGINT")
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

