"""Suites: the shipped ones load; every kind of bad input names file, field and problem."""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from difftest.errors import SuiteError
from difftest.suites import wavio
from difftest.suites.suite import load_suite
from difftest.suites.voices import reference_frames, samples_at_model_rate

ROOT = Path(__file__).resolve().parent.parent
SUITES = ROOT / "cases" / "suites"


def test_shipped_suites_meet_their_brief():
    smoke = load_suite(SUITES / "smoke.yaml")
    assert len(smoke.segments) == 4 and len(smoke.voices) == 2
    vcc = load_suite(SUITES / "voice-clone-concurrency.yaml")
    assert len(vcc.segments) >= 16 and len(vcc.voices) >= 6
    lengths = [v.n_samples for v in vcc.voices.values()]
    assert any(n % 1920 == 0 for n in lengths) and any(n % 1920 for n in lengths)
    assert len({s.language for s in vcc.segments}) >= 3
    assert {"icl", "xvector"} <= {v.mode for v in vcc.voices.values()}
    book = load_suite(SUITES / "audiobook.yaml")
    for s in book.segments:  # decoder input = reference frames + generated frames crosses 300
        assert -(-s.voice.n_samples // 1920) + s.decode["max_new_tokens"] - 1 > 300


def _write_suite(tmp_path, doc, voices=("v1",), sr=24000, channels=1):
    for vid in voices:
        x = np.sin(np.arange(24000) / 10.0).astype(np.float32) * 0.3
        if channels > 1:  # the same signal on every channel, interleaved, under a header that says so
            data = bytearray(wavio.encode(np.repeat(x, channels), sr, "pcm16"))
            data[22:24] = channels.to_bytes(2, "little")
            data[28:32] = (sr * 2 * channels).to_bytes(4, "little")
            data[32:34] = (2 * channels).to_bytes(2, "little")
            (tmp_path / f"{vid}.wav").write_bytes(bytes(data))
        else:
            wavio.write(tmp_path / f"{vid}.wav", x, sr, "pcm16")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(doc) if isinstance(doc, dict) else doc)
    return p


def _doc(**over):
    d = {
        "name": "t",
        "decode": {"repetition_penalty": 1.0, "max_new_tokens": 10, "seed": 0},
        "voices": [{"id": "v1", "wav": "v1.wav", "transcript": "hello there"}],
        "segments": [{"id": "s1", "text": "Hi.", "language": "english", "voice": "v1"}],
    }
    d.update(over)
    return d


def test_valid_minimal_suite_normalises(tmp_path):
    s = load_suite(_write_suite(tmp_path, _doc()))
    seg = s.segments[0]
    assert seg.language == "English" and seg.task == "voice_clone"
    assert seg.decode == {"do_sample": False, "subtalker_dosample": False, "repetition_penalty": 1.0,
                          "max_new_tokens": 10, "seed": 0}
    assert s.chunks == {"initial_frames": 1, "frames": 25}
    assert len(seg.hash) == 64


@pytest.mark.parametrize("over, field, problem", [
    ({"segments": [{"id": "s1", "text": "a", "voice": "nope"}]}, "segments[s1].voice", "unknown voice 'nope'"),
    ({"segments": [{"id": "s1", "text": "a", "voice": "v1"}, {"id": "s1", "text": "b", "voice": "v1"}]},
     "segments[1].id", "duplicate segment id 's1'"),
    ({"segments": [{"id": "s1", "text": "a", "voice": "v1", "language": "Klingon"}]},
     "segments[s1].language", "unknown language 'Klingon'"),
    ({"decode": {"repetition_penalty": 1.0, "max_new_tokens": -5, "seed": 0}},
     "decode.max_new_tokens", "must lie in 2..8192, got -5"),
    ({"decode": {"repetition_penalty": 1.0, "max_new_tokens": 10**20, "seed": 0}},
     "decode.max_new_tokens", "must lie in 2..8192"),
    ({"segments": [{"id": "s1", "text": "a" * 5001, "voice": "v1"}]}, "segments[s1].text",
     "5001 characters, more than the 5000"),
    ({"decode": {"max_new_tokens": 5, "seed": 0}}, "decode.repetition_penalty", "is required"),
    ({"decode": {"repetition_penalty": 1.0, "max_new_tokens": 5, "seed": 0, "do_sample": "no"}},
     "decode.do_sample", "expected true or false"),
    ({"voices": [{"id": "v1", "wav": "missing.wav", "transcript": "x"}]}, "voices[v1].wav", "file not found"),
    ({"voices": [{"id": "v1", "wav": "v1.wav", "transcript": "x"}, {"id": "v1", "wav": "v1.wav", "transcript": "y"}]},
     "voices[1].id", "duplicate voice id 'v1'"),
    ({"voices": [{"id": "v1", "wav": "v1.wav"}]}, "voices[v1].transcript", "needs the reference transcript"),
    ({"segments": [{"id": "s1", "text": "  ", "voice": "v1"}]}, "segments[s1].text", "is empty"),
    ({"segments": [{"id": "s1", "text": "a", "task": "voice_design"}]}, "segments[s1].instructions", "needs instructions"),
    ({"segments": [{"id": "s1", "text": "a", "task": "custom_voice", "voice": "v1", "speaker": "alice"}]},
     "segments[s1].voice", "not used by a custom_voice segment"),
    ({"segments": [{"id": "s1", "text": "a", "voice": "v1", "colour": "red"}]}, "segments[s1].colour", "unknown field"),
    ({"chunks": {"initial_frames": 0}}, "chunks.initial_frames", "must be a positive integer"),
    ({"segments": []}, "segments", "expected a non-empty list"),
    # #34 item 11: ids name files; `..` would put a segment's artifacts in the run folder's parent
    ({"segments": [{"id": "..", "text": "a", "voice": "v1"}]}, "segments[0].id", "must begin with a letter or digit"),
    ({"segments": [{"id": ".", "text": "a", "voice": "v1"}]}, "segments[0].id", "must begin with a letter or digit"),
    ({"segments": [{"id": ".hidden", "text": "a", "voice": "v1"}]}, "segments[0].id", "must begin with a letter"),
    ({"segments": [{"id": "a/b", "text": "a", "voice": "v1"}]}, "segments[0].id", "may only hold ASCII letters"),
    ({"voices": [{"id": "..", "wav": "v1.wav", "transcript": "x"}]}, "voices[0].id", "must begin with a letter"),
    ({"segments": [{"id": "s" * 101, "text": "a", "voice": "v1"}]}, "segments[0].id", "101 characters"),
    # #34 item 10: a model that is no id, no folder and not tiny fails validation, not the run
    ({"model": "no-such-model"}, "model", "expected tiny (the seeded tiny Qwen3-TTS checkpoints), tiny-hazard (the "
                                          "same with massive activations), tiny-omni (a seeded tiny Qwen3-Omni), "
                                          "a Hugging Face id"),
    ({"description": "d" * 5001}, "description", "5001 characters"),
])
def test_invalid_suites_name_field_and_problem(tmp_path, over, field, problem):
    p = _write_suite(tmp_path, _doc(**over))
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == field
    assert problem in e.value.problem
    assert str(p) in str(e.value)


def test_a_suite_names_either_tiny_build(tmp_path):
    assert load_suite(_write_suite(tmp_path, _doc())).model == "tiny"
    assert load_suite(_write_suite(tmp_path, _doc(model="tiny-hazard"))).model == "tiny-hazard"


def test_non_mono_wav(tmp_path):
    # stereo is what users upload: loaded, its rate and channels kept, its bytes sent as they are
    v = load_suite(_write_suite(tmp_path, _doc(), channels=2)).voices["v1"]
    assert (v.sample_rate, v.channels, v.n_samples) == (24000, 2, 24000)
    assert v.wav_sha256 == hashlib.sha256((tmp_path / "v1.wav").read_bytes()).hexdigest()
    # more than two channels is nothing a user uploads as a voice
    p = _write_suite(tmp_path, _doc(), channels=3)
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == "voices[v1].wav"
    assert e.value.problem == "v1.wav has 3 channels; a reference voice is mono or stereo"


def test_non_pcm_wav(tmp_path):
    p = _write_suite(tmp_path, _doc())
    wavio.write(tmp_path / "v1.wav", np.zeros(2400), 24000, "float")
    with pytest.raises(SuiteError, match="32-bit float, not PCM"):
        load_suite(p)


@pytest.mark.parametrize("sr", [8000, 16000, 22050, 44100, 48000])
def test_other_sample_rates_within_8_to_48_khz_load_as_uploaded(tmp_path, sr):
    v = load_suite(_write_suite(tmp_path, _doc(), sr=sr)).voices["v1"]
    assert (v.sample_rate, v.channels, v.n_samples) == (sr, 1, 24000)  # frames at its own rate


def test_a_voice_s_length_and_reference_frames_are_counted_at_24_khz():
    """ceil(n * 24000 / rate) samples once resampled, ceil(that / 1920) reference frames (the
    resampled suite's table, cases/suites/resampled.yaml)."""
    table = [(40960, 16000, 61440, 32), (57230, 22050, 62292, 33), (137592, 44100, 74880, 39),
             (142000, 44100, 77279, 41), (93001, 48000, 46501, 25), (115200, 48000, 57600, 30),
             (58000, 24000, 58000, 31), (61440, 24000, 61440, 32)]
    for n, rate, at_24k, frames in table:
        assert (samples_at_model_rate(n, rate), reference_frames(n, rate)) == (at_24k, frames), (n, rate)


@pytest.mark.parametrize("sr", [7999, 96000])
def test_other_sample_rate(tmp_path, sr):
    p = _write_suite(tmp_path, _doc(), sr=sr)
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == "voices[v1].wav"
    assert e.value.problem == f"v1.wav is {sr} Hz; a reference voice is 8000-48000 Hz (the model's is 24000)"


def test_truncated_wav(tmp_path):
    p = _write_suite(tmp_path, _doc())
    data = (tmp_path / "v1.wav").read_bytes()
    (tmp_path / "v1.wav").write_bytes(data[:1000])
    with pytest.raises(SuiteError, match="truncated"):
        load_suite(p)


def test_broken_yaml_names_line(tmp_path):
    p = _write_suite(tmp_path, "name: t\nsegments: [\n  - {id: a\n")
    with pytest.raises(SuiteError, match=r"line \d+: not valid YAML"):
        load_suite(p)


def test_missing_suite_file(tmp_path):
    with pytest.raises(SuiteError, match="not found"):
        load_suite(tmp_path / "nope.yaml")


def test_segment_hash_covers_reference_audio_bytes_and_decode(tmp_path):
    p = _write_suite(tmp_path, _doc())
    h1 = load_suite(p).segments[0].hash
    assert load_suite(p).segments[0].hash == h1  # stable
    x, _ = wavio.read(tmp_path / "v1.wav")
    x[100] += 1 / 32768
    wavio.write(tmp_path / "v1.wav", x, 24000, "pcm16")
    h2 = load_suite(p).segments[0].hash
    assert h2 != h1
    p.write_text(yaml.safe_dump(_doc(decode={"repetition_penalty": 1.05, "max_new_tokens": 10, "seed": 0})))
    assert load_suite(p).segments[0].hash not in (h1, h2)


def test_hash_does_not_depend_on_where_the_suite_lives(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    h1 = load_suite(_write_suite(a, _doc())).segments[0].hash
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert load_suite(b / "s.yaml").segments[0].hash == h1


def test_an_8_bit_voice_is_refused(tmp_path):
    p = _write_suite(tmp_path, _doc())
    x = (np.sin(np.arange(24000) / 10.0) * 100 + 128).astype(np.uint8)
    wavio.write(tmp_path / "v1.wav", x.astype(np.float32) / 128 - 1, 24000, "pcm16")
    data = bytearray((tmp_path / "v1.wav").read_bytes())
    # the same header as 8-bit PCM: block align 1, 8 bits per sample, one byte a sample
    data[32:34], data[34:36] = (1).to_bytes(2, "little"), (8).to_bytes(2, "little")
    data[28:32] = (24000).to_bytes(4, "little")
    body = bytes(x)
    data[40:44] = len(body).to_bytes(4, "little")
    (tmp_path / "v1.wav").write_bytes(bytes(data[:44]) + body)
    assert wavio.info((tmp_path / "v1.wav").read_bytes()).bits == 8
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == "voices[v1].wav" and "8-bit; use 16-bit PCM" in e.value.problem


def test_a_transcript_file_that_is_not_utf8_is_named(tmp_path):
    doc = _doc(voices=[{"id": "v1", "wav": "v1.wav", "transcript_file": "v1.txt"}])
    p = _write_suite(tmp_path, doc)
    (tmp_path / "v1.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert (e.value.field, e.value.problem) == ("voices[v1].transcript_file", "v1.txt is not UTF-8 text")


def test_the_seeds_production_scenario_is_generated_the_same_every_time(tmp_path):
    """cases/make_audiobook_suite.py: 278 segments over 6 cloned voices, alternating, deterministic,
    and the committed cases/suites/audiobook-278.yaml is what it writes."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    gen = [sys.executable, str(repo / "cases" / "make_audiobook_suite.py")]
    text = subprocess.run([*gen, "--out", "-"], capture_output=True, text=True, check=True).stdout
    assert text == (repo / "cases" / "suites" / "audiobook-278.yaml").read_text()
    s = load_suite(repo / "cases" / "suites" / "audiobook-278.yaml")
    assert len(s.segments) == 278 and len(s.voices) == 6
    assert [seg.voice.id for seg in s.segments[:7]] == ["alba", "jonas", "hugo", "iris", "bruno", "chloe", "alba"]
    assert len({seg.text for seg in s.segments}) == 278  # no two segments alike
    other = subprocess.run([*gen, "--out", "-", "--seed", "1", "--segments", "20", "--voices", "3"],
                           capture_output=True, text=True, check=True).stdout
    (tmp_path / "s.yaml").write_text(other.replace("../voices/", str(repo / "cases" / "voices") + "/"))
    small = load_suite(tmp_path / "s.yaml")
    assert len(small.segments) == 20 and len(small.voices) == 3 and small.segments[0].text != s.segments[0].text


@pytest.mark.parametrize("body, line, problem", [
    # #34 item 3: PyYAML keeps the last of two keys; a suite (or policy) edited twice would test the second silently
    ("name: t\nname: u\n", "line 2", "duplicate key 'name' (first on line 1, again on line 2)"),
    ("name: t\ndecode: {seed: 0, seed: 1}\n", "line 2", "duplicate key 'seed'"),
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, body, line, problem):
    p = tmp_path / "s.yaml"
    p.write_text(body)
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == line and problem in e.value.problem


def _alias_bomb(where: str) -> str:
    """Nine levels of nine aliases: 9**9 strings once expanded, a few hundred bytes on disk."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + f"\n{where}: *l8\n"


@pytest.mark.parametrize("where", ["description", "language"])
def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path, where):
    """#34 item 12: it took 1.1 GB in `description`; in `language` the error line was 58 MB."""
    import resource

    p = tmp_path / "s.yaml"
    p.write_text(_alias_bomb(where))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert "aliases expand to more than" in e.value.problem and len(str(e.value)) < 300
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: nothing was expanded


def test_a_huge_value_is_quoted_short(tmp_path):
    doc = _doc(segments=[{"id": "s1", "text": "a", "voice": "v1", "language": ["x" * 1000] * 500}])
    p = _write_suite(tmp_path, doc)
    with pytest.raises(SuiteError) as e:
        load_suite(p)
    assert e.value.field == "segments[s1].language" and len(str(e.value)) < 400
