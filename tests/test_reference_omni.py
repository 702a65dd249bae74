"""Qwen3-Omni's reference (issue 60): transformers' Qwen3OmniMoeForConditionalGeneration on a seeded
tiny checkpoint built from its own classes, run through `difftest reference` as a suite names it.

Real parts only: transformers 4.57.3 in .venv-reference, the builder, the runner over the protocol."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from reference_support import REPO, reference_python

from difftest.engines.reference import ReferenceOptions, family_tiny, run_reference
from difftest.errors import SuiteError
from difftest.family import QWEN3_OMNI, QWEN3_TTS, family_of_model
from difftest.results import read_result
from difftest.suites.checkpoints import MANIFEST
from difftest.suites.suite import content_hash, load_suite
from runners.reference_omni.tiny_checkpoint import CODEC_SPECIAL_IDS, SPEAKERS

SUITE = REPO / "cases" / "suites" / "omni-smoke.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("omni-store")


@pytest.fixture(scope="module")
def reference(store):
    """omni-smoke through the reference, once: the run and the suite."""
    suite = load_suite(SUITE)
    return run_reference(suite, store, ReferenceOptions(python=str(reference_python()))), suite


def test_the_suite_names_its_family_by_its_model():
    suite = load_suite(SUITE)
    assert suite.family is QWEN3_OMNI
    assert [s.task for s in suite.segments] == ["chat"] * 4
    assert [s.speaker for s in suite.segments] == ["Ethan", "Chelsie", "Aiden", "Ethan"]
    assert load_suite(REPO / "cases" / "suites" / "smoke.yaml").family is QWEN3_TTS
    assert family_of_model("tiny") is QWEN3_TTS and family_of_model("tiny-omni") is QWEN3_OMNI
    assert family_of_model("Qwen/Qwen3-Omni-30B-A3B-Instruct") is QWEN3_OMNI
    assert family_of_model("Qwen/Qwen3-TTS-12Hz-1.7B-Base") is QWEN3_TTS


@pytest.mark.parametrize("edit, where, problem", [
    ({"task": "voice_clone"}, "segments[omni-01].task", "is not one of chat"),
    ({"speaker": None}, "segments[omni-01].speaker", "expected a string"),
    ({"language": "German"}, "segments[omni-01].language", "unknown language 'German'"),
])
def test_a_segment_outside_the_family_is_refused_by_name(tmp_path, edit, where, problem):
    raw = SUITE.read_text().replace("    task: chat\n    speaker: Ethan\n", "".join(
        f"    {k}: {v}\n" for k, v in {"task": "chat", "speaker": "Ethan", **edit}.items() if v is not None), 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(raw)
    with pytest.raises(SuiteError) as e:
        load_suite(bad)
    assert where in str(e.value) and problem in str(e.value)


def test_a_thinker_setting_in_a_family_without_a_thinker_is_refused(tmp_path):
    raw = (REPO / "cases" / "suites" / "smoke.yaml").read_text().replace("  seed: 0\n", "  seed: 0\n  thinker_max_new_tokens: 4\n", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(raw)
    with pytest.raises(SuiteError, match=r"decode\.thinker_max_new_tokens.*unknown field"):
        load_suite(bad)


def test_the_tiny_checkpoint_is_seeded_and_has_the_released_ids(store, reference):
    folder = Path(family_tiny(store, reference_python(), QWEN3_OMNI)[0])  # built by the run: kept as it is
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["family"] == "qwen3-omni" and manifest["seed"] == 0 and manifest["type"] == "qwen3_omni_moe"
    config = json.loads((folder / "config.json").read_text())
    talker = config["talker_config"]
    assert talker["codec_eos_token_id"] == QWEN3_OMNI.stop_id and talker["num_code_groups"] == QWEN3_OMNI.codebooks
    assert talker["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert config["thinker_config"]["text_config"]["vocab_size"] == 152064  # vLLM-Omni's hard-coded ids need it
    assert talker["code_predictor_config"]["vocab_size"] == QWEN3_OMNI.codebook_size
    # the same seed again, elsewhere: byte for byte the same files
    again = Path(family_tiny(store / "again", reference_python(), QWEN3_OMNI)[0])
    assert json.loads((again / MANIFEST).read_text())["files"] == manifest["files"]


def test_omni_smoke_through_the_reference(reference):
    run, suite = reference
    assert run.errors == {} and sorted(run.results) == [s.id for s in suite.segments]
    assert run.config_dir.name.startswith("transformers-qwen3-omni-")
    for seg in suite.segments:
        r = run.results[seg.id]
        frames = seg.decode["max_new_tokens"] - 1  # the talker never stops: its last token is no frame
        assert r.codes.shape == (frames, QWEN3_OMNI.codebooks)
        assert 0 <= r.codes.min() and r.codes.max() < QWEN3_OMNI.codebook_size
        # code2wav's causal transposed convolutions trim 555 samples of the last 300-frame window
        assert len(r.wav) == frames * QWEN3_OMNI.samples_per_frame - 555
        assert np.isfinite(r.wav).all() and 0.02 < r.wav.std() < 0.5 and np.abs(r.wav).max() < 1
        assert len(r.extra["answer_ids"]) == seg.decode["thinker_max_new_tokens"]
        assert np.array_equal(r.extra["talker_codes"], r.codes)  # transformers hands the talker's frames on as they are
        assert r.provenance["decode"]["subtalker_greedy"] is True and r.provenance["speaker"] == seg.speaker
        # what the talker's prompt was made of, as generate built it: the chat turn, the speaker's id
        assert np.array_equal(r.extra["input_text_ids"], r.extra["prompt_ids"])
        assert r.extra["input_speaker_id"].tolist() == [SPEAKERS[seg.speaker.lower()]]
        assert r.extra["input_codec_prefill"].tolist() == [CODEC_SPECIAL_IDS[k] for k in (
            "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")]
    # the inputs reach the codes: another speaker or another text changes every frame's codebook 0
    a, b, d = (run.results[i].codes for i in ("omni-01", "omni-02", "omni-04"))
    assert (a[:, 0] != b[:len(a), 0]).mean() > 0.8 and (a[:, 0] != d[:len(a), 0]).mean() > 0.8


def test_greedy_is_seed_independent_and_cached_results_are_reused(store, reference):
    run, suite = reference
    again = run_reference(suite, store, ReferenceOptions(python=str(reference_python())))
    assert again.cached == {s.id for s in suite.segments}
    seg = suite.segments[0]
    reseeded = replace(seg, decode={**seg.decode, "seed": 123})
    reseeded = replace(reseeded, hash=content_hash(reseeded.fingerprint()))
    other = run_reference(replace(suite, segments=[reseeded]), store, ReferenceOptions(python=str(reference_python())))
    r0, r1 = run.results[seg.id], other.results[seg.id]
    assert other.cached == set() and np.array_equal(r0.codes, r1.codes) and np.array_equal(r0.wav, r1.wav)


def test_a_speaker_the_checkpoint_lacks_is_bad_input_and_the_rest_is_kept(store, reference):
    _, suite = reference
    seg = replace(suite.segments[0], speaker="Nobody")
    seg = replace(seg, hash=content_hash(seg.fingerprint()))
    out = run_reference(replace(suite, segments=[seg, suite.segments[1]]), store,
                        ReferenceOptions(python=str(reference_python())))
    assert out.errors[seg.id]["kind"] == "bad_input" and "unknown speaker 'Nobody'" in out.errors[seg.id]["message"]
    assert "chelsie" in out.errors[seg.id]["message"] and suite.segments[1].id in out.cached


def test_cross_decode_of_its_own_codes_gives_its_own_audio(store, reference, tmp_path):
    from difftest.engines.reference import runner_argv, runner_env
    from difftest.process.runner_client import RunnerProcess

    r = reference[0].results["omni-03"]
    np.savez(tmp_path / "codes.npz", codes=r.codes)
    folder = family_tiny(store, reference_python(), QWEN3_OMNI)
    opts = ReferenceOptions()
    runner = RunnerProcess(runner_argv(reference_python(), folder, opts, QWEN3_OMNI), env=runner_env(opts),
                           log_path=tmp_path / "runner.log", cwd=REPO)
    try:
        runner.start()
        events = list(runner.request("decode", timeout=300, items=[
            {"name": "x", "input": str(tmp_path / "codes.npz"), "out": str(tmp_path / "x")}]))
    finally:
        runner.close()
    done = [e for e in events if e.get("event") == "result"]
    assert len(done) == 1, events
    assert np.array_equal(read_result(done[0]["path"]).wav, r.wav)


def test_the_suite_is_checked_against_the_omni_checkpoint_before_any_model_work(store, reference):
    from difftest.suites.checkpoints import checkpoint_type, facts, problems

    _, suite = reference
    folder = family_tiny(store, reference_python(), QWEN3_OMNI)[0]
    assert checkpoint_type(folder) == "qwen3_omni_moe" and facts(folder).speakers == {"chelsie", "ethan", "aiden"}
    assert checkpoint_type("Qwen/Qwen3-Omni-30B-A3B-Instruct") == "qwen3_omni_moe"
    assert problems(suite, [folder]) == []
    seg = replace(suite.segments[1], speaker="Nobody")
    found = problems(replace(suite, segments=[suite.segments[0], seg]), [folder])
    assert found == [f"omni-smoke.yaml: segment omni-02: speaker 'Nobody' is not in the qwen3_omni_moe checkpoint "
                     f"{folder} (it has: aiden, chelsie, ethan)"]


@pytest.fixture(scope="module")
def omni_runner(store, reference, tmp_path_factory):
    """The reference runner over the protocol, for its score job."""
    from difftest.engines.reference import runner_argv, runner_env
    from difftest.process.runner_client import RunnerProcess

    folder = family_tiny(store, reference_python(), QWEN3_OMNI)
    opts = ReferenceOptions()
    runner = RunnerProcess(runner_argv(reference_python(), folder, opts, QWEN3_OMNI), env=runner_env(opts),
                           log_path=tmp_path_factory.mktemp("omni-runner") / "runner.log", cwd=REPO)
    runner.start()
    yield runner
    runner.close()


def _score(runner, store, items: dict, dtype=None) -> dict:
    from difftest.engines.scorer import ScoreItem, Scorer

    scorer = Scorer(runner, store, 300, dtype=dtype)
    return scorer.score({name: ScoreItem(seg, codes, None, False) for name, (seg, codes) in items.items()})


def test_teacher_forcing_gives_the_reference_its_own_greedy_choices(store, reference, omni_runner):
    """Every position of every reference stream is its top-1 when forced back through transformers'
    talker and code predictor: the forced prompt and forward are generation's own."""
    run, suite = reference
    got = _score(omni_runner, store, {s.id: (s, run.results[s.id].codes) for s in suite.segments})
    for seg in suite.segments:
        sf = got[seg.id]
        assert not isinstance(sf, str), sf
        frames = seg.decode["max_new_tokens"] - 1
        assert sf.arrays["rank"].shape == (frames, QWEN3_OMNI.codebooks)
        assert (sf.arrays["rank"] == 0).all() and sf.arrays["in_support"].all()
        assert (sf.arrays["margin"] >= 0).all() and sf.settings["subtalker_dosample"] is False
        assert sf.settings["do_sample"] is False and sf.settings["eos_token_id"] == QWEN3_OMNI.stop_id


def test_a_changed_code_is_scored_off_the_top_where_it_changed_and_not_before(store, reference, omni_runner):
    run, suite = reference
    seg = suite.segments[0]
    own = run.results[seg.id].codes
    c0, c7 = own.copy(), own.copy()
    c0[3, 0] = (c0[3, 0] + 1) % QWEN3_OMNI.codebook_size
    c7[2, 7] = (c7[2, 7] + 1) % QWEN3_OMNI.codebook_size
    got = _score(omni_runner, store, {"own": (seg, own), "c0": (seg, c0), "c7": (seg, c7)})
    base = got["own"].arrays["logprob"]
    r0, r7 = got["c0"].arrays, got["c7"].arrays
    assert r0["rank"][3, 0] > 0 and np.array_equal(r0["logprob"][:3], base[:3])  # causal: frames before unchanged
    assert r7["rank"][2, 7] > 0 and (r7["rank"][2, :7] == 0).all()
    assert np.array_equal(r7["logprob"][:2], base[:2]) and np.array_equal(r7["logprob"][2, :7], base[2, :7])


def test_a_score_item_the_family_cannot_take_is_refused_by_name(store, reference, omni_runner, tmp_path):
    run, suite = reference
    seg = suite.segments[0]
    np.savez(tmp_path / "in.npz", codes=run.results[seg.id].codes)
    bad = np.full((4, QWEN3_OMNI.codebooks), QWEN3_OMNI.codebook_size + 5)
    np.savez(tmp_path / "bad.npz", codes=bad)
    job = {"segment": seg.to_job(), "out": str(tmp_path / "o")}
    events = list(omni_runner.request("score", timeout=300, items=[
        {**job, "name": "given", "input": str(tmp_path / "in.npz"), "condition": "given"},
        {**job, "name": "ids", "input": str(tmp_path / "bad.npz"), "out": str(tmp_path / "o2")}]))
    errors = {e["item"]: e["message"] for e in events if e.get("event") == "error"}
    assert "no in-context reference codes" in errors["given"]
    assert errors["ids"] == (f"score item ids (segment {seg.id}): codes file {tmp_path / 'bad.npz'}: codes holds ids "
                             f"outside [0, {QWEN3_OMNI.codebook_size})")


def test_the_null_decodes_and_scores_in_bfloat16_and_is_refused_batched(store, reference, omni_runner):
    """The measured null's pieces: transformers in bf16, codes only, each request alone; waves refused."""
    from difftest.engines.reference import ReferenceEngine

    run, suite = reference
    engine = ReferenceEngine(omni_runner, store, 300)
    null = engine.generate(suite.segments[:2], dtype="bfloat16", codes_only=True)
    assert null.errors == {} and null.config_dir != run.config_dir
    for seg in suite.segments[:2]:
        r = null.results[seg.id]
        assert r.codes.shape == run.results[seg.id].codes.shape and len(r.wav) == 0
        assert r.meta["codes_only"] is True and r.provenance["dtype"] == "bfloat16"
    got = _score(omni_runner, store, {s.id: (s, null.results[s.id].codes) for s in suite.segments[:2]}, "bfloat16")
    assert all(not isinstance(sf, str) and sf.provenance["dtype"] == "bfloat16" for sf in got.values()), got
    assert omni_runner.hello["generate_waves"] is False
    waves = engine.generate_waves([suite.segments[:2]], dtype="bfloat16")
    assert set(waves.errors) == {s.id for s in suite.segments[:2]}
    assert "one request at a time" in waves.errors[suite.segments[0].id]["message"]
