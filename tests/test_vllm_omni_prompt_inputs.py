"""vLLM-Omni 0.30's real prompt builder, wrapped by difftest's capture observer, without a server
(tests/vllm_omni_prompt_inputs_check.py runs in `.venv-vllm-omni`, once for the whole file: one
process importing vLLM-Omni is about 10 s of CPU).

The capture's talker input (issue #29), on every task and layout: the observer must change nothing
the builder returns and must report what the builder used: here, what it must have used, from the
tokenizer and the config; with a defect planted in the builder's config, the defect.

The talker's assembled prompt (`input_prompt_embeds`, issue 57 item 5), from the talker's real
`preprocess` as model runner v1 calls it, wrapped as a server wraps it: on every task the rows the
builder returned, exactly; over a chunked prefill the rows of every step, with the pad rows past the
prompt; once per request; a defect that moves a prompt block (cases/planted/speaker-row-moved,
instruct-after-header, their patches applied to a copy of the release's builder) keeps every input_*
array equal and changes exactly the moved rows.

The same requests through qwen-tts's prompt code (the real reference runner) and vLLM-Omni's
builder, judged by difftest's talker-input comparison (difftest/verdicts/talker_input.py). Where
the two agree, the comparison finds nothing. Where vLLM-Omni 0.30.0 departs from qwen-tts, it
names the field: two such places were found reading the two prompt codes, and each is shown here
on a copy of the tiny custom-voice checkpoint whose config has what the released one has
(docs/verdicts.md, "Where vLLM-Omni 0.30.0's prompt is not qwen-tts's"):
- a dialect speaker asked for in Chinese: qwen-tts prompts the speaker's dialect, vLLM-Omni
  Mandarin (its override runs only when the language has no id of its own, i.e. for Auto);
- an instruction to a 0.6B CustomVoice checkpoint: qwen-tts drops it, vLLM-Omni prompts it.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from reference_support import generate, segment, start_runner, tiny  # noqa: F401
from vllm_omni_support import REPO, run_in_env

from difftest.engines.capture import INPUT
from difftest.results import read_result
from difftest.verdicts.talker_input import compare, inputs_of

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): the builder's observed inputs on every task
# and layout; CI sees the capture of the real server's prompt in test_vllm_omni.py.
pytestmark = pytest.mark.heavy

SICHUAN = 2062  # the released checkpoints' sichuan_dialect language id
CHINESE = 2055
DECODE = {"do_sample": False, "subtalker_dosample": False, "repetition_penalty": 1.0, "max_new_tokens": 3, "seed": 0}

# name: (checkpoint variant, segment fields)
CASES = {
    "cv-en": ("custom_voice", dict(text="Hello world.", language="English", task="custom_voice", speaker="bob")),
    "cv-de-instruct": ("custom_voice", dict(text="Guten Morgen.", language="German", task="custom_voice",
                                            speaker="alice", instructions="Whisper.")),
    "vd-fr": ("voice_design", dict(text="Bonjour.", language="French", task="voice_design",
                                   instructions="A calm voice.")),
    "dialect-zh": ("cv-dialect", dict(text="你好。", language="Chinese", task="custom_voice", speaker="alice")),
    "dialect-auto": ("cv-dialect", dict(text="你好。", language="Auto", task="custom_voice", speaker="alice")),
    "instruct-0b6": ("cv-0b6", dict(text="Hello world.", language="English", task="custom_voice", speaker="alice",
                                    instructions="Whisper.")),
}
API_TASK = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
# the observer's cases, built by the check script itself
OBSERVED = ("custom_voice", "custom_voice_streaming_instruct", "voice_design", "xvector_auto", "icl_streaming",
            "icl_non_streaming_batched", "icl_streaming_planted")


def _variant(src: Path, dst: Path, edit) -> Path:
    """A copy of a tiny checkpoint (files linked) with its config edited and no builder manifest:
    an ordinary checkpoint folder to both qwen-tts and vLLM-Omni."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "difftest-checkpoint.json"):
            os.symlink(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _dialect(cfg):  # as the released CustomVoice config has it for eric
    cfg["talker_config"]["codec_language_id"]["sichuan_dialect"] = SICHUAN
    cfg["talker_config"]["spk_is_dialect"]["alice"] = "sichuan_dialect"


def _small(cfg):
    cfg["tts_model_size"] = "0b6"


@pytest.fixture(scope="module")
def _builders(tiny, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("builders")
    paths = {"custom_voice": tiny / "custom_voice", "voice_design": tiny / "voice_design",
             "cv-dialect": _variant(tiny / "custom_voice", work / "cv-dialect", _dialect),
             "cv-0b6": _variant(tiny / "custom_voice", work / "cv-0b6", _small)}
    segs = {name: segment(name, decode=DECODE, **fields) for name, (_, fields) in CASES.items()}
    theirs = {}
    for variant in sorted({v for v, _ in CASES.values()}):  # one runner per checkpoint of a task
        runner = start_runner([str(paths[variant])])
        try:
            mine = [segs[n] for n, (v, _) in CASES.items() if v == variant]
            events = generate(runner, mine, work / "ref")
            failed = [e for e in events if e.get("event") == "error"]
            assert not failed, failed
        finally:
            runner.close()
        for s in mine:
            theirs[s.id] = inputs_of(read_result(work / "ref" / f"{s.id}.{s.hash[:16]}.json"))
    requests = {}
    for name, (variant, f) in CASES.items():
        info = {"text": [f["text"]], "language": [f["language"]]}
        if "speaker" in f:
            info["speaker"] = [f["speaker"]]
        if "instructions" in f:
            info["instruct"] = [f["instructions"]]
        requests[name] = {"path": str(paths[variant]), "task_type": API_TASK[f["task"]], "info": info}
    (work / "cases.json").write_text(json.dumps(requests))
    out = run_in_env([str(REPO / "tests" / "vllm_omni_prompt_inputs_check.py"), str(tiny), str(work / "cases.json")],
                     timeout=600)
    return out, theirs


@pytest.fixture(scope="module")
def both(_builders):
    """(vLLM-Omni's prompt inputs, qwen-tts's) per cross case."""
    out, theirs = _builders
    return {name: _arrays(obs) for name, obs in out["cross"].items()}, theirs


@pytest.fixture(scope="module")
def checked(_builders):
    """The observer's cases (OBSERVED): what the wrapped builder returned and used, per case."""
    return _builders[0]


def _arrays(observed) -> dict:
    assert isinstance(observed, dict), f"vLLM-Omni's builder was not observed: {observed}"
    out = {}
    for name in INPUT:
        v = observed[name]
        if name == "input_speaker_embedding":
            out[name] = np.array(v, np.float32)
        elif name == "input_speaker_dtype":
            out[name] = np.array(v)
        elif name == "input_ref_codes":
            out[name] = np.array(v, np.int64).reshape(-1, 16)
        else:
            out[name] = np.array(v, np.int64)
    return out


@pytest.mark.parametrize("case", ["cv-en", "cv-de-instruct", "vd-fr", "dialect-auto"])
def test_where_the_two_prompt_codes_agree_nothing_is_flagged(both, case):
    vllm, qwen = both
    assert qwen[case] is not None, "the reference recorded no talker input"
    wrong, notes = compare(vllm[case], qwen[case])
    assert wrong == [] and notes == [], (wrong, notes)
    assert vllm[case]["input_codec_prefill"].size >= 3 and vllm[case]["input_text_ids"].size > 5


def test_a_dialect_speaker_in_chinese_is_prompted_in_mandarin_by_vllm_omni(both):
    vllm, qwen = both
    wrong, _ = compare(vllm["dialect-zh"], qwen["dialect-zh"])
    assert [m.field for m in wrong] == ["input_codec_prefill"], wrong
    assert qwen["dialect-zh"]["input_codec_prefill"][2] == SICHUAN
    assert vllm["dialect-zh"]["input_codec_prefill"][2] == CHINESE
    assert wrong[0].at == 2  # the language slot, named
    # with Auto both override to the dialect: the case above differs by the language alone
    assert qwen["dialect-auto"]["input_codec_prefill"][2] == SICHUAN


def test_an_instruction_to_a_small_custom_voice_model_is_kept_by_vllm_omni_only(both):
    vllm, qwen = both
    wrong, _ = compare(vllm["instruct-0b6"], qwen["instruct-0b6"])
    assert [m.field for m in wrong] == ["input_instruct_ids"], wrong
    assert qwen["instruct-0b6"]["input_instruct_ids"].size == 0  # qwen-tts: "0b6 ... instruct is not supported"
    assert vllm["instruct-0b6"]["input_instruct_ids"].size > 3
    # the same instruction to the 1.7B-sized checkpoint is prompted by both, identically (cv-de-instruct)
    assert qwen["cv-de-instruct"]["input_instruct_ids"].size > 3


# -- the observer's own cases --------------------------------------------------------------

@pytest.mark.parametrize("case", OBSERVED)
def test_the_observed_prompt_inputs_are_what_the_builder_used(checked, case):
    c = checked[case]
    assert c["same_output"], "the observer changed what build_prompt_embeds returned"
    assert isinstance(c["observed"], dict), f"not captured: {c['observed']}"
    for field, want in c["expect"].items():
        assert c["observed"][field] == want, (field, c["observed"][field], want)


def test_the_batched_path_and_the_planted_defect_are_what_they_claim(checked):
    assert checked["icl_non_streaming_batched"]["precomputed"]  # the ids came from preprocess_infos_batch
    assert not checked["icl_streaming"]["precomputed"]  # ... and here from the builder's own tokenizer call
    planted = checked["icl_streaming_planted"]
    assert planted["observed"]["input_codec_prefill"][2] != planted["english_id"]  # what was used, not what is right
    assert checked["icl_streaming"]["observed"]["input_codec_prefill"][2] == planted["english_id"]
    # streaming and non-streaming in-context prompts, and a custom voice's streaming layout, told apart
    assert [checked[c]["observed"]["input_non_streaming"] for c in
            ("icl_streaming", "icl_non_streaming_batched", "custom_voice", "custom_voice_streaming_instruct")] == [0, 1, 1, 0]


# -- the assembled prompt, as the talker's preprocess hands it to the forward ------------------

@pytest.mark.parametrize("case", OBSERVED[:-1])
def test_the_captured_prompt_rows_are_the_builders_prompt(checked, case):
    r = checked["rows"]["cases"][case]
    assert r["missing"] is None, r["missing"]
    assert r["equal_handed"] and r["equal_built"], r  # what preprocess returned = what the builder built
    assert r["shape"] == [r["rows_built"], 32] and r["embeds_dtype"] == "float32"
    assert (r["dtype"], r["cached"]) == ("bfloat16", 0)  # written as input_speaker_dtype is: no "torch."


def test_a_chunked_prefill_is_filed_whole_once_with_its_pad_rows(checked):
    rows = checked["rows"]
    r = rows["chunked"]  # three steps, two positions reserved past the prompt
    assert r["missing"] is None and r["equal_handed"] and r["equal_built"] and r["pad_rows"], r
    assert r["shape"][0] == r["length"] == r["rows_built"] + 2
    cut = rows["cut"]  # a reservation 3 short: the talker got (and the capture keeps) the first 14 rows
    assert cut["shape"][0] == cut["length"] == cut["rows_built"] - 3 and cut["equal_built"], cut
    cached = rows["cached"]  # a prefix-cache hit on the first 8 positions: those from the prompt built, said so
    assert cached["cached"] == 8 and cached["equal_built"] and cached["shape"][0] == cached["rows_built"], cached
    gap = rows["gap"]  # positions skipped: said, not guessed
    assert "input_prompt_embeds" not in gap["keys"] and "positions 5-7 never reached" in gap["input_prompt_missing"]


def test_a_prompt_recomputed_after_preemption_is_not_filed_again(checked):
    r = checked["rows"]["resume"]
    assert r["first"]["equal_handed"] and r["first"]["missing"] is None
    assert not r["kept_filed"]  # v1 keeps the buffer: nothing built, nothing filed
    assert r["rebuilt_keys"] is None  # built again (v2's way): neither the rows nor the input are filed again


@pytest.mark.parametrize("entry, case, rows", [
    ("speaker-row-moved", "custom_voice", [7, 8]),  # after 3 header rows and 4 prefill rows: speaker, pad
    ("speaker-row-moved", "custom_voice_streaming_instruct", [23, 24, 25]),  # 16 instruction rows earlier; bos
    ("instruct-after-header", "voice_design", list(range(1, 23))),  # 21 instruction rows and the header's
    ("instruct-after-header", "custom_voice_streaming_instruct", list(range(1, 18))),
])
def test_a_planted_block_moved_keeps_every_ingredient_and_changes_the_moved_rows(checked, entry, case, rows):
    """Only the prompt rows see these: every input_* array equals the release's. The rows that
    differ are those between the block's old and new place (the first and last rows of the
    instruction and the header are <|im_start|> and a newline alike)."""
    r = checked["rows"]["planted"][f"{entry}/{case}"]
    assert r["same_inputs"], r
    assert r["differ"] == rows, r
