"""The talker's assembled prompt against qwen-tts's, row by row (issue 57, item 5): every ingredient
right but a row moved, dropped or duplicated is a talker_defect at talker_input naming the row and
what it should hold; float32 against float32 is exact (one ulp fails), bf16 rows within the measured
allowance pass; a differing field stays the finding; a prompt not captured says so. Hand-built
results (numpy only); the capture's reading of the new arrays with the same distrust as the rest."""

import numpy as np
import pytest
from test_verdicts_talker_input import CODES, OWN, _bf16, ev, inputs
from toy import toy_result

from difftest.engines import capture
from difftest.engines.capture import PROMPT_ROWS
from difftest.verdicts.classify import Evidence, classify

# qwen-tts's layout of an in-context clone, streaming (runners/reference/prompt_inputs.py, row_names)
LAYOUT = (["role"] * 3 + ["codec prefill"] * 4 + ["speaker", "codec pad", "reference text + codec bos"]
          + ["reference text + reference codes"] * len(OWN))
SPEAKER = LAYOUT.index("speaker")  # 7


def rows(seed=0, n=len(LAYOUT)):
    return np.random.default_rng(100 + seed).standard_normal((n, 64)).astype(np.float32)


def prompt(embeds=None, dtype="float32", labels=True, **kw):
    """A clean input (test_verdicts_talker_input's) with its assembled prompt."""
    e = rows() if embeds is None else embeds
    out = {**inputs(**kw), "input_prompt_embeds": e, "input_prompt_dtype": np.array(dtype)}
    if labels:
        out["input_prompt_rows"] = np.array([PROMPT_ROWS.index(r) for r in LAYOUT], np.int64)
    return out


def moved():
    e = rows()
    e[[SPEAKER, SPEAKER + 1]] = e[[SPEAKER + 1, SPEAKER]]
    return e


def test_the_same_prompt_is_compared_row_by_row_and_recorded_as_equal(policy):
    v = classify(ev(prompt(labels=False), control=prompt(labels=False), theirs=prompt()), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["talker_prompt"] == {
        "rows": len(LAYOUT), "reference_rows": len(LAYOUT), "compared": len(LAYOUT), "skipped": 0,
        "dtype": "float32", "allowed_rel": 0.0, "worst_rel": 0.0, "worst_row": 0, "equal": True,
        "first_differing_row": None}


def test_a_row_moved_with_every_ingredient_right_is_a_talker_defect_naming_the_row(policy):
    v = classify(ev(prompt(moved(), labels=False), control=prompt(moved()), theirs=prompt()), policy)
    assert (v.verdict, v.stage, v.first_divergent_chunk, v.donor) == ("talker_defect", "talker_input", 0, None)
    assert v.comparisons["talker_input"]["differ"] == []  # every ingredient is qwen-tts's
    assert v.summary == (f"the talker's assembled prompt differs from qwen-tts's at row 7 of {len(LAYOUT)} (it "
                         f"should hold the speaker row): the row there is qwen-tts's row 8 (codec pad) at "
                         f"concurrency 1 as well")
    assert v.comparisons["talker_prompt"]["first_differing_row"] == 7 and not v.comparisons["talker_prompt"]["equal"]
    assert policy.fails(v.verdict)
    # wrong only at N: said so
    v = classify(ev(prompt(moved()), control=prompt(), theirs=prompt()), policy)
    assert v.summary.endswith("at concurrency N (right at 1)"), v.summary


def test_a_row_dropped_or_duplicated_is_named_with_the_row_counts(policy):
    dropped = np.delete(rows(), SPEAKER, axis=0)
    v = classify(ev(prompt(dropped), theirs=prompt()), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert v.summary.startswith("the talker's assembled prompt differs from qwen-tts's at row 7 of 30 (it should "
                                "hold the speaker row): the row there is qwen-tts's row 8 (codec pad)"), v.summary
    assert v.summary.endswith(f"; 29 rows against qwen-tts's 30"), v.summary
    duplicated = np.insert(rows(), SPEAKER, rows()[SPEAKER], axis=0)
    v = classify(ev(prompt(duplicated), theirs=prompt()), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert "at row 8 of 30 (it should hold the codec pad row): the row there is qwen-tts's row 7 (speaker)" in v.summary
    assert "31 rows against qwen-tts's 30" in v.summary
    # rows put in front (prompt-padded's shape, #1554) or the first ones lost: said so
    padded = np.concatenate([rows(seed=9, n=3), rows()])
    v = classify(ev(prompt(padded), theirs=prompt()), policy)
    assert v.summary.endswith("; 33 rows against qwen-tts's 30, and qwen-tts's whole prompt follows them: 3 rows "
                              "put in front of it"), v.summary
    v = classify(ev(prompt(rows()[2:]), theirs=prompt()), policy)
    assert v.summary.endswith("; 28 rows against qwen-tts's 30, and they are qwen-tts's without its first 2 rows")
    # a row added at the end: the prefix is qwen-tts's, the first differing row is where its prompt ends
    longer = np.concatenate([rows(), rows(seed=9, n=1)])
    v = classify(ev(prompt(longer), theirs=prompt()), policy)
    assert ("at row 30 of 30 (it should hold nothing: qwen-tts's prompt ends there): a row qwen-tts's prompt "
            "does not hold; 31 rows against qwen-tts's 30") in v.summary, v.summary


def test_one_ulp_in_float32_fails_and_bf16_noise_within_the_allowance_passes(policy):
    ulp = rows()
    ulp[12, 5] = np.nextafter(ulp[12, 5], np.float32(np.inf))
    v = classify(ev(prompt(ulp), theirs=prompt()), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert "at row 12 of 30 (it should hold the reference text + reference codes row): max |diff| " in v.summary
    assert v.comparisons["talker_prompt"]["allowed_rel"] == 0.0
    # bf16 rows against qwen-tts's float32 ones: rounding (at most 2^-9 of a value) and some arithmetic
    # noise, inside the measured allowance; the x-vector's twin keeps the speaker field judged too
    theirs = {**prompt(), "speaker_embedding_bf16": _bf16(inputs()["input_speaker_embedding"])}
    noisy = _bf16(rows() * (1 + 0.004 * np.random.default_rng(3).standard_normal(rows().shape)).astype(np.float32))
    bf16 = {**prompt(noisy, dtype="bfloat16"), "input_speaker_dtype": np.array("bfloat16"),
            "input_speaker_embedding": theirs["speaker_embedding_bf16"]}
    v = classify(ev(bf16, control=bf16, theirs=theirs), policy)
    assert v.verdict == "identical", v.summary
    got = v.comparisons["talker_prompt"]
    assert got["equal"] and got["dtype"] == "bfloat16" and got["allowed_rel"] == policy.prompt_bf16_max_rel
    assert 0 < got["worst_rel"] < policy.prompt_bf16_max_rel
    # a moved row stays far outside it
    bad = noisy.copy()
    bad[[SPEAKER, SPEAKER + 1]] = bad[[SPEAKER + 1, SPEAKER]]
    v = classify(ev({**bf16, "input_prompt_embeds": bad}, theirs=theirs), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert "at row 7 of 30 (it should hold the speaker row): the row there is qwen-tts's row 8 (codec pad)" in v.summary


def test_a_differing_field_stays_the_finding_and_the_prompt_difference_is_a_note(policy):
    mine = {**prompt(moved()), "input_codec_prefill": np.array([2154, 2156, 2051, 2157])}
    v = classify(ev(mine, theirs=prompt()), policy)
    assert v.summary.startswith("the talker's input differs from qwen-tts's in its codec prefill (language)")
    assert any(n.startswith("the talker's assembled prompt differs from qwen-tts's as well, at row 7 of 30")
               for n in v.notes), v.notes
    assert v.comparisons["talker_prompt"]["first_differing_row"] == 7


def test_a_prompt_not_captured_on_either_side_is_not_compared_and_the_notes_say_so(policy):
    v = classify(ev(inputs(), theirs=prompt()), policy)
    assert v.verdict == "identical" and "talker_prompt" not in v.comparisons
    assert any(n.startswith("the talker's assembled prompt was not captured: its assembly not compared")
               for n in v.notes), v.notes
    v = classify(ev(prompt(), theirs=inputs()), policy)
    assert v.verdict == "identical" and "talker_prompt" not in v.comparisons
    assert any(n.startswith("no assembled prompt from qwen-tts") for n in v.notes), v.notes
    # float16 rows: no tolerance measured against float32
    v = classify(ev(prompt(dtype="float16"), theirs=prompt()), policy)
    assert v.verdict == "identical" and any("its rows are float16, qwen-tts's float32, and no tolerance" in n
                                            for n in v.notes), v.notes


def test_rows_a_prefix_cache_hit_kept_from_the_forward_are_said(policy):
    v = classify(ev({**prompt(), "input_prompt_cached": np.array(4)}, theirs=prompt()), policy)
    assert v.verdict == "identical" and v.comparisons["talker_prompt"]["cached"] == 4
    assert any(n.startswith("the first 4 rows of the talker's assembled prompt came from the prefix cache")
               for n in v.notes), v.notes


def test_rows_holding_another_encoders_reference_frames_are_left_to_the_encoder_check(policy):
    """A bf16 encoder's reference codes differ from float32 qwen-tts's in some frames: the prompt holds the
    engine's own (the encoder check judges them), so the rows holding those frames cannot equal qwen-tts's
    and are left out; the rows holding frames both encoders made alike are compared."""
    near = OWN.copy()
    near[::10, 3] = (near[::10, 3] + 1) % 2048  # frames 0 and 10 differ
    first = LAYOUT.index("reference text + reference codes")  # holds frame 0
    e = rows()
    e[[first, first + 10]] += 1.0  # other frames: other rows

    def judged(embeds):
        mine = prompt(embeds, ref=near)
        cand = toy_result("a", CODES, near, extra={"talker_ref_codes": near, "talker_prompt": np.array([0, 0, 20]),
                                                   "talker_tokens": np.append(CODES[:, 0], 2150), **mine})
        return classify(Evidence(segment_id="a", reference=toy_result("a", CODES, OWN, extra=prompt()),
                                 candidate=cand, control=None,
                                 cross_own=toy_result("a", CODES, near), cross_donors={},
                                 peer_ref_codes={"b": OWN}), policy)

    v = judged(e)
    assert v.stage != "talker_input", v.summary
    got = v.comparisons["talker_prompt"]
    assert got["equal"] and got["skipped"] == 2 and got["compared"] == len(LAYOUT) - 2
    assert any(n.startswith("2 rows of the talker's assembled prompt not compared: they hold reference frames")
               for n in v.notes), v.notes
    e[first + 1] += 1e-3  # a frame both encoders made alike: its row is judged
    v = judged(e)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert f"at row {first + 1} of 30 (it should hold the reference text + reference codes row)" in v.summary


def test_a_row_of_another_requests_prompt_names_it_as_the_donor(policy):
    """A row the segment's own prompt holds nowhere, equal to a row of another request's qwen-tts prompt."""
    other = {**prompt(rows(seed=5)), "input_text_ids": np.array([151644, 77091, 198, 1, 2, 151645])}
    leaked = rows()
    leaked[10] = rows(seed=5)[10]
    v = classify(ev(prompt(leaked), control=prompt(), others={"b": other}, theirs=prompt()), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind) == ("contamination", "talker_input", "b", "prompt row"), \
        v.summary
    assert v.summary.startswith("the talker's assembled prompt holds a row of b's prompt, at row 10 of 30")
    assert v.summary.endswith("at concurrency N (right at 1)")
    # a row moved within its own prompt names no donor, though every request shares some rows (role, prefill)
    v = classify(ev(prompt(moved()), control=prompt(), others={"b": prompt()}, theirs=prompt()), policy)
    assert (v.verdict, v.donor) == ("talker_defect", None)


def test_a_capture_round_trips_the_prompt_and_refuses_a_broken_one(tmp_path):
    good = {"codes": CODES, "ref_codes": OWN, "wav": np.zeros(40 * 1920, np.float32),
            "talker_ref_codes": OWN, "talker_prompt": np.array([0, 0, len(OWN)]),
            "talker_tokens": np.append(CODES[:, 0], 2150), **prompt(labels=False)}
    cap = capture.load(capture.write(tmp_path / "ok.npz", good))
    assert set(cap.inputs) == {*capture.INPUT, *capture.PROMPT}
    assert np.array_equal(cap.stage_arrays()["input_prompt_embeds"], rows())
    assert str(cap.inputs["input_prompt_dtype"]) == "float32"
    labelled = capture.load(capture.write(tmp_path / "labels.npz", {**good, **prompt()}))
    assert [PROMPT_ROWS[i] for i in labelled.inputs["input_prompt_rows"]] == LAYOUT
    older = {k: v for k, v in good.items() if not k.startswith("input_prompt")}  # an older capture: not captured
    assert set(capture.load(capture.write(tmp_path / "old.npz", older)).inputs) == set(capture.INPUT)
    broken = {
        "input_prompt_embeds must be float32 \\(rows, hidden\\)": {"input_prompt_embeds": np.zeros(64, np.float32)},
        "input_prompt_embeds\\[3, 2\\] is nan": {"input_prompt_embeds": np.where(
            np.arange(len(LAYOUT) * 64).reshape(-1, 64) == 3 * 64 + 2, np.nan, rows()).astype(np.float32)},
        "input_prompt_dtype must be one of float32, bfloat16, float16": {"input_prompt_dtype": np.array("int8")},
        "input_prompt_rows must hold one index into PROMPT_ROWS": {"input_prompt_rows": np.array([99] * len(LAYOUT))},
        "input_prompt_embeds has shape \\(2, 16385\\), more than a talker prompt may hold": {
            "input_prompt_embeds": np.zeros((2, capture.MAX_PROMPT_HIDDEN + 1), np.float32)},
    }
    for i, (why, change) in enumerate(broken.items()):
        path = capture.write(tmp_path / f"bad{i}.npz", {**good, **change})
        with pytest.raises(capture.CaptureError, match=f"^{path}: {why}"):
            capture.load(path)
    # float64 rows are refused, not cast (the writer's encode casts; a file written another way is checked)
    path = tmp_path / "f64.npz"
    np.savez(path, **{k: np.asarray(v) for k, v in good.items()} | {"input_prompt_embeds": rows().astype(np.float64),
                                                                    "schema_version": np.int64(3)})
    with pytest.raises(capture.CaptureError, match="input_prompt_embeds must be float32"):
        capture.load(path)
    # a writer that tried and could not read the rows: an error, as input_missing is
    with pytest.raises(capture.CaptureError, match="the talker's assembled prompt was not captured \\(a gap\\)"):
        capture.load(capture.write(tmp_path / "missing.npz", {**older, "input_prompt_missing": np.array("a gap")}))
    # rows a prefix-cache hit kept from the forward (vLLM-Omni's writer says how many): read, bounded
    cached = capture.load(capture.write(tmp_path / "cached.npz", {**good, "input_prompt_cached": 4}))
    assert int(cached.inputs["input_prompt_cached"]) == 4
    with pytest.raises(capture.CaptureError, match="input_prompt_cached 31 outside \\[0, 30\\]"):
        capture.load(capture.write(tmp_path / "cached2.npz", {**good, "input_prompt_cached": 31}))
    alone = {k: v for k, v in good.items() if k != "input_prompt_dtype"}
    with pytest.raises(capture.CaptureError, match="input_prompt_embeds and input_prompt_dtype come together"):
        capture.load(capture.write(tmp_path / "alone.npz", alone))
    no_input = {k: v for k, v in good.items() if k in ("codes", "ref_codes", "wav") or k.startswith("input_prompt")}
    with pytest.raises(capture.CaptureError, match="input_prompt_\\* without the input_\\* arrays"):
        capture.load(capture.write(tmp_path / "noinput.npz", no_input))
