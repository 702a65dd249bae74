"""The qwen-tts zygote (runners/zygote.py, difftest/process/zygote.py): a runner forked from it is the
runner a fresh interpreter would have been (same result bytes, exit codes, /proc view), and a
request it cannot stand in for starts a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reference_support import all_models, reference_python, tiny, write_voice  # noqa: F401

from difftest.engines import reference
from difftest.process import lifeline, zygote
from difftest.suites.suite import load_suite

SUITE = """\
name: zyg
model: tiny
decode: {repetition_penalty: 1.0, max_new_tokens: 12, seed: 3}
voices:
  - {id: anna, wav: anna.wav, transcript: "A short reference sentence."}
segments:
  - {id: icl, text: "First sentence.", language: English, voice: anna}
  - {id: design, text: "Third.", task: voice_design, instructions: "Slow and deep."}
"""


@pytest.fixture(scope="module")
def sock(_qwen_tts_zygote) -> Path:
    """The session's zygote, once it listens (its start imports torch and qwen-tts)."""
    if _qwen_tts_zygote is None:
        pytest.fail("no zygote in this session: .venv-reference is missing or DIFFTEST_TEST_ZYGOTE=0", pytrace=False)
    deadline = time.monotonic() + 600
    while not Path(str(_qwen_tts_zygote) + ".env.json").exists():
        assert time.monotonic() < deadline, "the zygote did not listen within 600 s (tests' basetemp zygote.log)"
        time.sleep(0.2)
    return _qwen_tts_zygote


def _env(**extra) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", **extra)


def _py() -> str:
    return str(reference_python())


def test_a_forked_runner_writes_the_bytes_a_fresh_one_writes(sock, tiny, tmp_path, monkeypatch):
    """The reference runner on two threads (OpenMP's pool in use), forked and fresh: every file it
    writes to the store is the same, byte for byte."""
    d = tmp_path / "suite"
    d.mkdir()
    write_voice(d / "anna.wav", 1.1, 180.0, seed=4)
    (d / "suite.yaml").write_text(SUITE)
    suite = load_suite(d / "suite.yaml")
    options = reference.ReferenceOptions(models=all_models(tiny), python=_py(), threads=2)
    assert zygote.refusal(reference.runner_argv(Path(_py()), [], options), reference.runner_env(options)) is None
    before = zygote.stats(str(sock))["forks"]
    forked = reference.run_reference(suite, tmp_path / "forked", options)
    assert zygote.stats(str(sock))["forks"] == before + 1  # the runner was a fork, not a fresh interpreter
    monkeypatch.delenv(zygote.ENV)
    fresh = reference.run_reference(suite, tmp_path / "fresh", options)
    assert not forked.errors and not fresh.errors and sorted(forked.results) == ["design", "icl"]
    a, b = (sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.suffix in (".npz", ".wav"))
            for root in (tmp_path / "forked", tmp_path / "fresh"))
    assert a == b and a
    for rel in a:
        assert (tmp_path / "forked" / rel).read_bytes() == (tmp_path / "fresh" / rel).read_bytes(), rel
    for sid in forked.results:
        assert np.array_equal(forked.results[sid].codes, fresh.results[sid].codes)


@pytest.mark.parametrize("code, want", [("raise SystemExit(3)", 3), ("raise ValueError('x')", 1), ("pass", 0),
                                        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
                                        ("raise KeyboardInterrupt", -2)])
def test_exit_status_is_the_interpreters(sock, tmp_path, code, want):
    pkg = tmp_path / "zyg_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(f"import sys\nprint('argv', sys.argv[1:], flush=True)\n{code}\n")
    p = zygote.popen([_py(), "-m", "zyg_probe", "a", "b"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     env=_env(), cwd=tmp_path, text=True)
    assert isinstance(p, zygote.ForkedProcess), zygote.refusal([_py(), "-m", "zyg_probe"], _env())
    out, err = p.stdout.read(), p.stderr.read()
    assert p.wait(60) == want, err
    assert out.startswith("argv ['a', 'b']")
    if want == 1:
        assert "ValueError: x" in err


def test_the_proc_view_is_the_childs_and_a_stray_is_reported(sock, tmp_path):
    """cmdline and environ say `python -m MODULE ...` and the child's owner tag: tools and
    lifeline.stale() see a forked runner as a fresh one. Its owner (pid 1, another start time) is gone."""
    p = zygote.popen([_py(), "-m", "http.server", "0", "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, env=_env(**{lifeline.OWNER_ENV: "1:0"}), start_new_session=True)
    try:
        assert isinstance(p, zygote.ForkedProcess), zygote.refusal([_py(), "-m", "http.server"], _env())
        cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmd == [_py().encode(), b"-m", b"http.server", b"0", b"--bind", b"127.0.0.1"]
        assert os.getpgid(p.pid) == p.pid  # a session of its own, as start_new_session gives
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.2)
        assert p.pid in [pid for pid, _ in lifeline.stale()]
    finally:
        os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM


@pytest.mark.parametrize("argv, env", [
    (["-c", "print(1)"], {}),  # not `-m`
    (["-m", "json.tool"], {"OMP_NUM_THREADS": "3"}),  # read by OpenMP when torch loads: the zygote's is fixed
    (["-m", "json.tool"], {"PYTHONHASHSEED": "7"}),  # read by the interpreter at its start
])
def test_what_a_fork_cannot_stand_for_starts_fresh(sock, argv, env):
    p = zygote.popen([_py(), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(**env), text=True)
    assert isinstance(p, subprocess.Popen)
    out, _ = p.communicate("{}" if argv[1] == "json.tool" else None, timeout=120)
    assert p.returncode == 0 and out.strip() in ("1", "{}")


def test_another_interpreter_or_no_zygote_starts_fresh(sock, tmp_path):
    cases = [(sys.executable, _env()),  # the tester's interpreter: no zygote serves it
             (_py(), {k: v for k, v in _env().items() if k != zygote.ENV}),  # none named
             (_py(), _env(**{zygote.ENV: f"{_py()}={tmp_path / 'none.sock'}"}))]  # named, not there
    for python, env in cases:
        p = zygote.popen([python, "-m", "json.tool", "--help"], stdout=subprocess.DEVNULL, env=env)
        assert isinstance(p, subprocess.Popen) and p.wait(120) == 0


def test_a_starting_zygote_is_waited_for_while_it_lives(tmp_path):
    """A zygote still importing writes SOCKET.starting with its pid: a request waits for it (bounded),
    but not for one that died while starting."""
    sock = str(tmp_path / "z.sock")
    Path(sock + ".starting").write_text("999999999")  # no such process
    t0 = time.monotonic()
    assert zygote._hello_env(sock, wait=30) is None and time.monotonic() - t0 < 5
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Path(sock + ".starting").write_text(str(sleeper.pid))
        t0 = time.monotonic()
        assert zygote._hello_env(sock, wait=1.0) is None and 1.0 <= time.monotonic() - t0 < 10
        Path(sock + ".env.json").write_text('{"HF_HUB_OFFLINE": "1"}')  # it listens now
        assert zygote._hello_env(sock, wait=30) == {"HF_HUB_OFFLINE": "1"}
    finally:
        sleeper.kill()
        sleeper.wait()


_SYS_VIEW = ("import json, sys\nimport zyg_overlay_pkg as pkg\nprint(json.dumps({'executable': sys.executable, "
             "'prefix': sys.prefix, 'path': sys.path[1:], 'pkg': pkg.__file__}))\n")


def test_an_overlay_of_the_zygotes_interpreter_is_forked_as_that_interpreter(sock, tmp_path):
    """A bisect build's overlay venv (its own site-packages and an editable path first, then the
    base's): the fork sees what `OVERLAY/bin/python -m MODULE` sees (executable, prefix, sys.path in
    order, where its package comes from). An overlay holding a module the zygote has imported
    (numpy) starts fresh."""
    from difftest.bisect.builds import make_overlay

    with open(tmp_path / "build.log", "w") as log:
        python = make_overlay(Path(_py()), tmp_path / "env", log)
    src = tmp_path / "src"
    (src / "zyg_overlay_pkg").mkdir(parents=True)
    (src / "zyg_overlay_pkg" / "__init__.py").write_text("")
    (src / "zyg_overlay_pkg" / "__main__.py").write_text(_SYS_VIEW)
    site = next((tmp_path / "env").glob("lib/python*/site-packages"))
    (site / "__editable__.zyg_overlay_pkg-0.1.pth").write_text(f"{src}\n")  # compat mode: a path entry
    argv = [str(python), "-m", "zyg_overlay_pkg"]
    before = zygote.stats(str(sock))["forks"]
    forked = zygote.run(argv, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert zygote.stats(str(sock))["forks"] == before + 1, zygote.refusal(argv, _env())
    fresh = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert forked.returncode == 0 == fresh.returncode, forked.stderr + fresh.stderr
    view = json.loads(forked.stdout.splitlines()[-1])
    assert view == json.loads(fresh.stdout.splitlines()[-1])
    assert view["executable"] == str(python) and view["pkg"] == str(src / "zyg_overlay_pkg" / "__init__.py")
    assert view["path"].index(str(site)) < view["path"].index(str(src)) < view["path"].index(
        str(Path(_py()).parent.parent / site.relative_to(tmp_path / "env")))

    (site / "numpy").mkdir()  # shadows a module the zygote has imported: a fork would give the wrong one
    assert "holds numpy, which the zygote has imported" in zygote.refusal(argv, _env())
    p = zygote.popen(argv, stdout=subprocess.DEVNULL, env=_env(), cwd=tmp_path)
    assert isinstance(p, subprocess.Popen)
    p.wait(120)
