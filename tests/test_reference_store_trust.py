"""A voice edited while the reference runs cannot put a result in the store under another voice's key
(issue 56, item 8). The runner's own pieces, in process, with a stand-in for qwen-tts that reads the
reference audio it is given as qwen-tts does (by path), and a hook that edits the voice file at a
chosen point: no model, no race."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from reference_support import segment, voice, write_voice

from difftest.results import ResultStore, read_result
from runners.reference.checkpoint import Checkpoint
from runners.reference.engine import QwenTTSEngine, Synthesis
from runners.reference.service import ReferenceService

BASE = Checkpoint("fake-base", Path("/nonexistent"), {"tts_model_type": "base",
                                                       "talker_config": {"codec_language_id": {"english": 1}}}, {})


class _Prompt:
    ref_code = None


class _FakeTTS:
    """qwen-tts's create_voice_clone_prompt as far as the voice goes: it opens `ref_audio` itself."""

    def __init__(self, before_read=None):
        self.before_read, self.read = before_read, []

    def create_voice_clone_prompt(self, ref_audio, ref_text=None, x_vector_only_mode=False):
        if self.before_read:
            self.before_read()
        self.read.append(Path(ref_audio).read_bytes())
        return [_Prompt()]


class _FakeEngine(QwenTTSEngine):
    """QwenTTSEngine's own _voice_prompt; the 'audio' is the sha256 of the voice bytes qwen-tts read."""

    def __init__(self, tts):
        super().__init__({"voice_clone": BASE}, dtype="bfloat16")  # bfloat16: no second (bf16) prompt
        self.tts = tts

    def is_loaded(self, task):
        return True

    def model(self, task):
        return self.tts

    def synthesize(self, u):
        self._voice_prompt(self.tts, u)
        wav = np.zeros(1920, np.float32)
        wav[:32] = np.frombuffer(hashlib.sha256(self.tts.read[-1]).digest(), np.uint8)
        return Synthesis(codes=np.zeros((1, 16), np.int64), ref_codes=np.zeros((0, 16), np.int64), wav=wav,
                         sample_rate=24000)


def _digest_wav(data: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(data).digest(), np.uint8).astype(np.float32)


def _generate(tmp_path, seg, tts) -> tuple[list[dict], Path]:
    events, store = [], tmp_path / "store"
    svc = ReferenceService({"voice_clone": BASE}, _FakeEngine(tts), {"runner": "test"})
    svc.generate({"segments": [seg.to_job()], "out_dir": str(store), "concurrency": 1},
                 lambda event, **f: events.append({"event": event, **f}))
    side = ResultStore.stem(store, seg.id, seg.hash)
    return events, side.with_name(side.name + ".json")


def _setup(tmp_path):
    wav = write_voice(tmp_path / "anna.wav", 1.1, 180.0, seed=4)
    edited = write_voice(tmp_path / "edited.wav", 1.1, 330.0, seed=5).read_bytes()
    return wav, wav.read_bytes(), edited, segment("s1", "First sentence.", voice=voice(wav, vid="anna"))


def test_a_voice_edited_between_the_runners_check_and_qwen_tts_read_does_not_reach_the_store(tmp_path):
    wav, original, edited, seg = _setup(tmp_path)
    tts = _FakeTTS(before_read=lambda: wav.write_bytes(edited))  # the edit lands after the runner hashed
    events, side = _generate(tmp_path, seg, tts)
    wav.write_bytes(original)  # ... and is undone: later runs key the segment by the original again
    assert [e["event"] for e in events] == ["result"]
    assert tts.read == [original]  # qwen-tts got the bytes the segment's key was made from
    r = read_result(side)
    assert np.array_equal(r.wav[:32], _digest_wav(original))
    assert r.provenance["voice"]["wav_sha256"] == seg.voice.wav_sha256 == hashlib.sha256(original).hexdigest()


def test_a_voice_edited_before_the_runner_reads_it_is_refused_and_nothing_is_stored(tmp_path):
    wav, original, edited, seg = _setup(tmp_path)
    wav.write_bytes(edited)  # after the suite hashed it (the key), before the runner reads it
    tts = _FakeTTS()
    events, side = _generate(tmp_path, seg, tts)
    assert [(e["event"], e["segment"], e["kind"]) for e in events] == [("error", "s1", "bad_input")]
    assert str(wav) in events[0]["message"] and "changed since the suite was loaded" in events[0]["message"]
    assert tts.read == [] and not side.exists() and not side.with_suffix(".npz").exists()


def test_an_unchanged_voice_is_stored_as_before(tmp_path):
    wav, original, _, seg = _setup(tmp_path)
    tts = _FakeTTS()
    events, side = _generate(tmp_path, seg, tts)
    assert [e["event"] for e in events] == ["result"] and events[0]["path"] == str(side)
    assert tts.read == [original] and np.array_equal(read_result(side).wav[:32], _digest_wav(original))
    assert wav.read_bytes() == original
