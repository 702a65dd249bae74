"""The exit-code contract on every path that used to end in a traceback: bad input exits 2 naming the
file or field, infrastructure exits 3, only a judged divergence exits 1, and no traceback reaches the
user. Each case here was reproduced against the first landing (a traceback, exit 1)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.results import atomic_write

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"


def difftest(*args, cwd, env=None):
    p = subprocess.run([sys.executable, "-m", "difftest", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=600, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no one may write into, root included (chattr +i; chmod is no bar to root)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.fail("this test needs chattr (e2fsprogs) to make a folder read-only for root", pytrace=False)
        subprocess.run(["chattr", "+i", str(d)], check=True)
    else:
        d.chmod(0o555)
    yield d
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    d.chmod(0o755)


def test_verbose_reference_help_and_usage(tmp_path):
    code, out, _ = difftest("-v", "reference", "--help", cwd=tmp_path)
    assert code == 0 and "--store" in out
    code, _, err = difftest("-v", "reference", SMOKE, cwd=tmp_path)
    assert code == 2 and "--store" in err  # the usage error, not a crash
    code, _, err = difftest("-v", "reference", SMOKE, "--store", tmp_path, "--python", tmp_path / "nope", cwd=tmp_path)
    assert code == 2 and "reference environment not found" in err


def test_out_that_is_a_file_or_read_only(tmp_path, read_only_dir):
    f = tmp_path / "a-file"
    f.write_text("x")
    code, _, err = difftest("run", SMOKE, "--candidate", "cpu-engine", "--out", f, "--store", tmp_path / "s",
                            cwd=tmp_path)
    assert code == 2 and f"--out {f}: exists and is not a folder" in err
    code, _, err = difftest("run", SMOKE, "--candidate", "cpu-engine", "--out", read_only_dir / "run",
                            "--store", tmp_path / "s", cwd=tmp_path)
    assert code == 2 and f"--out {read_only_dir / 'run'}: cannot write there" in err
    code, _, err = difftest("compare", tmp_path, tmp_path, "--out", f, cwd=tmp_path)
    assert code == 2


def test_policy_files_that_are_wrong(tmp_path):
    cases = {
        "typo.yaml": ("fail_onn:\n  - contamination\n", "fail_onn: unknown section"),
        "not-utf8.yaml": (b"tiers:\n  close_max_abs: 1e-3 # \xe9\n", "not UTF-8 text"),
        "section-type.yaml": ("tiers: 5\n", "tiers: expected a mapping, got int"),
        "key-typo.yaml": ("require:\n  concurency: close\n", "require.concurency: unknown key"),
        "no-fail-on.yaml": (Path(ROOT / "difftest" / "verdicts" / "default_policy.yaml").read_text().split("fail_on:")[0],
                            "fail_on: required"),
        # #34 item 3: PyYAML keeps the last of two keys; this policy passed a leaking run
        "fail-on-twice.yaml": (Path(ROOT / "difftest" / "verdicts" / "default_policy.yaml").read_text() + "fail_on: []\n",
                               "duplicate key 'fail_on' (first on line"),
    }
    for name, (text, problem) in cases.items():
        p = tmp_path / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        code, _, err = difftest("compare", tmp_path, tmp_path, "--out", tmp_path / "o", "--policy", p, cwd=tmp_path)
        assert code == 2 and f"{p}: " in err and problem in err, (name, err)


def test_candidate_urls_that_name_no_server(tmp_path):
    code, _, err = difftest("run", SMOKE, "--candidate", "http://127.0.0.1:99999", "--out", tmp_path / "o",
                            "--store", tmp_path / "s", cwd=tmp_path)
    assert code == 2 and "Port out of range" in err
    code, _, err = difftest("run", SMOKE, "--candidate", "http://", "--out", tmp_path / "o",
                            "--store", tmp_path / "s", cwd=tmp_path)
    assert code == 2 and "expected http://host:port" in err


@pytest.mark.parametrize("command", ["gate", "log"])
def test_malformed_reports_given_to_gate_and_log(tmp_path, command):
    extra = ["--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"] if command == "log" else []
    for body, problem in ((b"{not json", "not valid JSON"),
                          (b'{"format": "difftest.report/1", "segments": 5}', "segments: expected list, got int"),
                          (b'{"format": "difftest.report/1", "segments": [{"id": 1, "verdict": "pass"}]}',
                           "segments[0].id: expected str, got int"),
                          (b'{"format": "difftest.report/1", "segments": [{"id": "a", "verdict": "bogus"}]}',
                           "segments[0].verdict: unknown verdict 'bogus'"),
                          (b'["a list"]', "format: not a difftest report")):
        (tmp_path / "report.json").write_bytes(body)
        code, _, err = difftest(command, tmp_path, *extra, cwd=tmp_path)
        assert code == 2 and problem in err, (body, err)


def test_an_unknown_planted_defect_is_refused_before_any_model_work(tmp_path):
    code, _, err = difftest("run", SMOKE, "--candidate", "cpu-engine:typo", "--out", tmp_path / "o",
                            "--store", tmp_path / "s", cwd=tmp_path)
    assert code == 2 and "has no defect 'typo' (known: batch-mixup" in err
    assert "reference [" not in err  # refused before the reference phase
    assert not list((tmp_path / "s").rglob("*.npz"))


def test_files_get_the_users_umask(tmp_path):
    old = os.umask(0o027)
    try:
        # atomic_write read the umask at import; a fresh interpreter sees this one
        code = ("from pathlib import Path; from difftest.results import atomic_write; "
                f"atomic_write(Path({str(tmp_path / 'f')!r}), b'x')")
        subprocess.run([sys.executable, "-c", code], check=True)
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    atomic_write(tmp_path / "g", b"x")  # this process: the usual 022
    assert (tmp_path / "g").stat().st_mode & 0o777 == 0o666 & ~old


def test_an_internal_error_is_one_line_and_exit_3(tmp_path):
    """A bug in difftest (here: a report field that passes the schema but breaks the Markdown) is
    reported as difftest's own failure, never as a verdict (exit 1) or a raw traceback."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    (tmp_path / "sitecustomize.py").write_text(
        "import difftest.records.gate_output as g\n"
        "def boom(*a, **k):\n    raise RuntimeError('planted')\n"
        "g.headline = boom\n")
    (tmp_path / "report.json").write_text(json.dumps({
        "format": "difftest.report/1", "verdict": "pass",
        "segments": [{"id": "a", "verdict": "identical"}]}))
    code, _, err = difftest("gate", tmp_path, cwd=tmp_path, env=env)
    assert code == 3 and "internal error: RuntimeError: planted" in err and "difftest-internal-error-" in err


SUBCOMMAND_NAMES = ("run", "matrix", "compare", "reference", "handoff", "bisect", "probe", "bugs", "repro", "selfcheck",
                    "gate", "log",
                    "dashboard", "validate", "cache")


def test_every_subcommand_is_registered_the_same_way():
    from difftest.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert tuple(sub.choices) == SUBCOMMAND_NAMES
    for name, parser in sub.choices.items():  # each with its handler (cache: each of its own subcommands)
        nested = [a for a in parser._actions if isinstance(a.choices, dict)]
        handlers = [p.get_default("func") for a in nested for p in a.choices.values()] or [parser.get_default("func")]
        assert all(callable(h) for h in handlers), name


def test_every_default_file_a_subcommand_names_in_the_checkout_exists():
    """A default path into this checkout (selfcheck's suite) is computed from its module's place:
    a module moved to another depth named a file that is not there (stop 67)."""
    from difftest.cli import build_parser

    repo = str(Path(__file__).resolve().parents[1])
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parsers = [p for p in sub.choices.values()]
    parsers += [q for p in parsers for a in p._actions if isinstance(a.choices, dict) for q in a.choices.values()]
    named = {a.default for p in parsers for a in p._actions
             if isinstance(a.default, str) and a.default.startswith(repo) and "/.venv" not in a.default}
    assert named and all(Path(d).exists() for d in named), named


@pytest.mark.parametrize("name", SUBCOMMAND_NAMES)
def test_every_subcommand_answers_help_and_refuses_bad_usage(tmp_path, name):
    code, out, _ = difftest("-v", name, "--help", cwd=tmp_path)
    assert code == 0 and out.startswith("usage: difftest")
    code, _, err = difftest("-v", name, "--no-such-option", cwd=tmp_path)
    # `probe` speaks git bisect's codes: a usage error aborts the bisect (128)
    assert code == (128 if name == "probe" else 2) and "error:" in err


def test_settings_and_folders_that_cannot_be_used_are_refused_before_any_model_work(tmp_path):
    """#34 items 3, 8, 9, 10, 13, each reproduced first: an engine argument the CPU test engine
    ignored (exit 0, as if that configuration had been tested), a --store that is a file (a
    traceback), a model that names nothing (validate passed, run exit 3), a deploy file with a key
    twice (tested as its last value), `bugs --only ,` (the whole corpus ran)."""
    f = tmp_path / "a-file"
    f.write_text("x")
    run = ("run", SMOKE, "--candidate", "cpu-engine", "--out", tmp_path / "o")
    code, _, err = difftest(*run, "--store", tmp_path / "s", "--engine-arg", "talker.no_such_key=1", cwd=tmp_path)
    assert code == 2 and "--engine-arg talker.no_such_key: vLLM-Omni settings; the CPU test engine" in err, err
    code, _, err = difftest(*run, "--store", f, cwd=tmp_path)
    assert code == 2 and f"--store {f}: exists and is not a folder" in err, err
    code, _, err = difftest("reference", SMOKE, "--store", f / "under", cwd=tmp_path)
    assert code == 2 and f"--store {f / 'under'}: exists and is not a folder (or lies under a file)" in err, err
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("async_chunk: false\nstage_args: []\nasync_chunk: true\n")
    code, _, err = difftest("run", SMOKE, "--candidate", "vllm-omni", "--out", tmp_path / "o", "--store", tmp_path / "s",
                            "--deploy-config", deploy, cwd=tmp_path)
    assert code == 2 and f"--deploy-config {deploy}: duplicate key 'async_chunk' (first on line 1, again on line 3)" in err, err
    (tmp_path / "suites").mkdir()
    suite = tmp_path / "suites" / "model.yaml"
    suite.write_text(SMOKE.read_text().replace("model: tiny", "model: no-such-model"))
    (tmp_path / "voices").symlink_to(ROOT / "cases" / "voices")
    for cmd in (("validate", suite), ("run", suite, "--candidate", "cpu-engine", "--out", tmp_path / "o2",
                                      "--store", tmp_path / "s")):
        code, _, err = difftest(*cmd, cwd=tmp_path)
        assert code == 2 and f"{suite}" in err and "model" in err and "no-such-model" in err, (cmd, err)
    code, _, err = difftest("bugs", "--only", ",", "--out", tmp_path / "b", cwd=tmp_path)
    assert code == 2 and "--only ',': names no entry" in err, err
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.npz"))
