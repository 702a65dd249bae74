"""An interrupt at any point ends with the documented exit code (3), one line, and nothing lost
(issue 56, item 15): also where the KeyboardInterrupt lands in code that swallows it (a garbage
collector's callback inside SQLAlchemy while MLflow logs), and during an upload (a pending note
for `difftest log`)."""
import json
import subprocess
import sys
import textwrap

import pytest
from mlflow_support import make_report

from difftest.records import tracking
from difftest.records.tracking import STATE

SWALLOWED = textwrap.dedent("""\
    import signal, sys
    from difftest.cli import dispatch

    class Collected:
        def __del__(self):  # what Python does with an exception raised here: print it, carry on
            signal.raise_signal(signal.SIGINT)
            sum(range(10000))  # the handler runs here, inside __del__

    def command(args):
        x = Collected()
        del x
        return 1  # the command carried on to its own verdict

    sys.exit(dispatch(command, None))
    """)


def test_an_interrupt_swallowed_on_the_way_still_ends_the_command_as_interrupted(tmp_path):
    p = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=120)
    assert "Exception ignored in" in p.stderr  # it was swallowed where it landed ...
    assert p.returncode == 3, p.stderr  # ... and the command still ends as interrupted, not with its exit 1
    assert p.stderr.strip().splitlines()[-1].startswith("difftest: interrupted (SIGINT)")


AFTER = textwrap.dedent("""\
    import atexit, signal, sys
    from difftest.cli import dispatch

    def command(args):
        signal.raise_signal(signal.SIGINT)  # interrupted ...
        return 0

    atexit.register(lambda: (signal.raise_signal(signal.SIGINT), sum(range(10000))))  # ... and again at exit
    sys.exit(dispatch(command, None))
    """)


def test_a_second_interrupt_while_the_interpreter_exits_changes_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-c", AFTER], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stderr)  # not 130 (killed by the signal, no word said)
    assert p.stderr.strip().splitlines() == ["difftest: interrupted (SIGINT); engines and runners it started are "
                                             "stopped, finished results kept"]


def test_an_interrupted_upload_leaves_a_pending_note(tmp_path, monkeypatch):
    out = make_report(tmp_path, "leak", leak_into=("s0",))

    def upload(*a, **k):
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(tracking, "_upload", upload)
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    with pytest.raises(KeyboardInterrupt):
        tracking.log_run(out, uri)
    pending = json.loads((out / STATE).read_text())["pending"]
    assert pending["tracking_uri"] == uri and pending["reason"] == "interrupted (SIGINT)"
    monkeypatch.undo()  # `difftest log OUT` then uploads where it was meant to go
    assert tracking.log_run(out) is not None
    assert "pending" not in json.loads((out / STATE).read_text())
