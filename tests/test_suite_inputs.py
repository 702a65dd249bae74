"""Issue 56: suites a hostile user writes. A voice may only name files where the suite may read
(item 6), a suite too large says which limit it passed (13), and max_new_tokens below what
qwen-tts can serve is refused at validation, not in the run (14)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from difftest.bugs.corpus import load_entry
from difftest.cli import main
from difftest.errors import SuiteError
from difftest.suites import wavio
from difftest.suites.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "cases"
ALLOW_ROOTS_ENV = "DIFFTEST_ALLOW_ROOTS"


@pytest.fixture(autouse=True)
def _no_roots(monkeypatch):
    """No allowed root from the environment."""
    monkeypatch.delenv(ALLOW_ROOTS_ENV, raising=False)


def _wav(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    wavio.write(path, (np.sin(np.arange(24000) / 10.0) * 0.3).astype(np.float32), 24000, "pcm16")
    return path


def _suite(folder: Path, voice: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"name": "t", "decode": {"repetition_penalty": 1.0, "max_new_tokens": 10, "seed": 0},
           "voices": [{"id": "v1", **voice}], "segments": [{"id": "s1", "text": "Hi.", "voice": "v1"}]}
    path = folder / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("voice, field, named", [
    ({"wav": "v1.wav", "transcript_file": "/proc/self/environ"}, "voices[v1].transcript_file", "/proc/self/environ"),
    ({"wav": "/etc/passwd", "transcript": "x"}, "voices[v1].wav", "/etc/passwd"),
    ({"wav": "v1.wav", "transcript_file": "../../../../../../../../etc/hostname"}, "voices[v1].transcript_file",
     "/etc/hostname"),
    ({"wav": "../../outside.wav", "transcript": "x"}, "voices[v1].wav", "outside.wav"),  # a real voice, outside
    ({"wav": "link.wav", "transcript": "x"}, "voices[v1].wav", "outside.wav"),  # a symlink in the folder, to outside
    ({"wav": "v1.wav\0", "transcript": "x"}, "voices[v1].wav", "NUL"),  # was a ValueError: exit 3
])
def test_a_voice_outside_the_suites_folder_is_refused(tmp_path, capsys, voice, field, named):
    folder = tmp_path / "a" / "b"
    _wav(folder / "v1.wav")
    (folder / "link.wav").symlink_to(_wav(tmp_path / "outside.wav"))
    path = _suite(folder, voice)
    with pytest.raises(SuiteError) as e:
        load_suite(path)
    assert e.value.field == field and named in e.value.problem
    assert main(["validate", str(path)]) == 2  # bad input, nothing read
    err = capsys.readouterr().err
    assert str(path) in err and field in err and named in err
    if named != "NUL":
        assert "outside the folders a suite may read" in err and "--allow-root DIR" in err


def test_a_folder_the_user_names_is_allowed(tmp_path, monkeypatch, capsys):
    outside = _wav(tmp_path / "voices" / "v.wav")
    (tmp_path / "voices" / "v.txt").write_text("the transcript")
    path = _suite(tmp_path / "suites", {"wav": "../voices/v.wav", "transcript_file": "../voices/v.txt"})
    assert main(["validate", str(path)]) == 2
    assert main(["validate", str(path), "--allow-root", str(outside.parent)]) == 0
    assert ALLOW_ROOTS_ENV not in os.environ  # the option holds while the command runs, no longer
    with pytest.raises(SystemExit) as e:  # not a folder: a usage error
        main(["validate", str(path), "--allow-root", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "--allow-root" in capsys.readouterr().err
    monkeypatch.setenv(ALLOW_ROOTS_ENV, str(tmp_path / "voices"))
    assert load_suite(path).voices["v1"].transcript == "the transcript"


def test_a_suite_repro_derives_may_name_its_origins_voices(tmp_path):
    """repro's probes write their suite in the run folder, naming the origin's voices by absolute path:
    the probe allows exactly those files, nothing else outside."""
    from difftest.repro import shrink
    from difftest.repro.probe import write_suite

    _wav(tmp_path / "mine" / "v1.wav")
    probe_of_mine = _suite(tmp_path / "probe", {"wav": str(tmp_path / "mine" / "v1.wav"), "transcript": "x"})
    with pytest.raises(SuiteError):  # not without the origin's allowance
        load_suite(probe_of_mine)
    origin = load_suite(_suite(tmp_path / "mine", {"wav": "v1.wav", "transcript": "x"}))
    also = frozenset(v.wav for v in origin.voices.values())
    with pytest.raises(SuiteError):  # still not, loaded alone: the allowance is the caller's, by name
        load_suite(probe_of_mine)
    assert load_suite(probe_of_mine, also=also).voices["v1"].wav == tmp_path / "mine" / "v1.wav"
    probe = load_suite(write_suite(origin, shrink.Case(("s1",), 1), tmp_path / "run" / "p1", "t-probe"), also=also)
    assert probe.voices["v1"].wav == tmp_path / "mine" / "v1.wav"
    _wav(tmp_path / "elsewhere" / "v1.wav")  # another file outside stays refused under the same allowance
    with pytest.raises(SuiteError):
        load_suite(_suite(tmp_path / "probe2", {"wav": str(tmp_path / "elsewhere" / "v1.wav"), "transcript": "x"}),
                   also=also)


def _shipped_suites() -> set[Path]:
    """Every suite the repository ships or names: cases/suites, the gates' cells, the bug corpora's
    entries, the findings' repro bundles."""
    paths = set((CASES / "suites").glob("*.yaml")) | set((ROOT / "docs").glob("findings/*/bundle/suite.yaml"))
    for gate in (CASES / "gates").glob("*.yaml"):
        paths |= {(gate.parent / c["suite"]).resolve() for c in yaml.safe_load(gate.read_text())["cells"]}
    paths |= {load_entry(f.parent).suite for f in CASES.glob("*/*/bug.yaml")}
    return paths


def test_every_shipped_suite_validates_without_allowed_roots():
    suites = sorted(map(str, _shipped_suites()))
    assert len(suites) >= 10
    for p in suites:
        load_suite(p)
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ROOTS_ENV}
    done = subprocess.run([sys.executable, "-m", "difftest", "validate", *suites], cwd="/", env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok: suite ") == len(suites)


def test_a_large_suite_without_aliases_names_the_node_limit(tmp_path, monkeypatch):
    """50,000 segments, no alias: the message was 'its aliases expand to more than 200000 nodes'. The
    limit is scaled down 40 times here, with the suite (composing 450,000 nodes takes PyYAML 20 s)."""
    from difftest import yamlfile

    monkeypatch.setattr(yamlfile, "MAX_NODES", 5_000)
    seg = "  - {{id: s{0}, text: Segment number {0}., language: English, voice: v1}}\n"
    text = ("name: big\ndecode: {repetition_penalty: 1.0, max_new_tokens: 10, seed: 0}\n"
            "voices: [{id: v1, wav: v1.wav, transcript: hi}]\nsegments:\n")
    text += "".join(seg.format(i) for i in range(1_250))
    (tmp_path / "s.yaml").write_text(text)
    _wav(tmp_path / "v1.wav")
    with pytest.raises(SuiteError) as e:
        load_suite(tmp_path / "s.yaml")
    assert e.value.field == "(file)" and "alias" not in e.value.problem
    assert e.value.problem.startswith("11272 nodes (")  # 9 a segment, 22 the rest
    assert "more than the 5000 difftest reads" in e.value.problem
    monkeypatch.setattr(yamlfile, "MAX_NODES", 11_272)
    assert len(load_suite(tmp_path / "s.yaml").segments) == 1_250  # the limit itself is allowed


@pytest.mark.parametrize("where", ["decode", "segments"])
def test_max_new_tokens_below_two_is_refused_at_validation(tmp_path, capsys, where):
    """qwen-tts makes max_new_tokens - 1 frames: 1 gave a raw torch RuntimeError in the run (exit 3)."""
    _wav(tmp_path / "v1.wav")
    path = _suite(tmp_path, {"wav": "v1.wav", "transcript": "x"})
    doc = yaml.safe_load(path.read_text())
    if where == "decode":
        doc["decode"]["max_new_tokens"] = 1
    else:
        doc["segments"][0]["decode"] = {"max_new_tokens": 1}
    path.write_text(yaml.safe_dump(doc))
    field = "decode.max_new_tokens" if where == "decode" else "segments[s1].decode.max_new_tokens"
    with pytest.raises(SuiteError) as e:
        load_suite(path)
    assert e.value.field == field and e.value.problem.startswith("must lie in 2..8192, got 1 (qwen-tts makes")
    assert main(["validate", str(path)]) == 2 and field in capsys.readouterr().err
    doc["decode"]["max_new_tokens"] = 2
    doc["segments"][0].pop("decode", None)
    path.write_text(yaml.safe_dump(doc))
    assert load_suite(path).segments[0].decode["max_new_tokens"] == 2  # one frame: the smallest that serves
