"""The bug corpus end to end: real vLLM-Omni 0.30.0 bugs re-created by reverting their fixes into
the release, served on the CPU, and caught by `difftest bugs` with the verdict, stage and donor the
corpus expects. One `difftest bugs` command (the CLI, as a maintainer runs it) over three entries;
each entry starts its own mutant server."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from vllm_omni_support import omni_python

from difftest.results import read_result

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): four mutant vLLM-Omni servers; CI sees
# a real leak caught in test_handoff.py.
pytestmark = pytest.mark.heavy

REPO = Path(__file__).resolve().parents[1]
ENTRIES = ("ref-leak-4373", "no-async-trim-4429", "prompt-len-fallback-1554", "prompt-len-float-ceil")


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bugs")
    p = subprocess.run([sys.executable, "-m", "difftest", "bugs", "--only", ",".join(ENTRIES), "--out", str(out / "run"),
                        "--vllm-omni-python", str(omni_python()), "--store", str(out / "store"), "--no-mlflow"],
                       capture_output=True, text=True, timeout=3000, cwd=out)
    table = json.loads((out / "run" / "bugs.json").read_text())
    return p, table, out / "run"


def _report(run: Path, entry: str) -> dict:
    return json.loads((run / entry / "report.json").read_text())


def test_every_entry_is_caught_and_the_table_says_so(corpus_run):
    p, table, _ = corpus_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["id"]: r for r in table["entries"]}
    assert table["complete"] and table["exit_code"] == 0 and set(rows) == set(ENTRIES)
    assert {r["status"] for r in rows.values()} == {"caught"}, rows
    assert f"caught {len(ENTRIES)} of {len(ENTRIES)} entries" in p.stdout
    for entry in ENTRIES:  # every entry ran against its mutant (or the release itself), and the report says which
        versions = _report(corpus_run[2], entry)["candidate"]["versions"]
        mutant = versions["vllm_omni_mutant"]
        assert versions["vllm_omni"] == "0.30.0"
        assert (mutant is None) if entry == "prompt-len-float-ceil" else (mutant["bug"] == entry)


def test_the_seed_leak_names_the_request_it_came_from(corpus_run):
    """#4370 re-created: the x-vector clones have no reference of their own; in their wave the one
    in-context clone's reference codes reach their vocoders, so it is the donor."""
    _, _, run = corpus_run
    rep = _report(run, "ref-leak-4373")
    assert rep["verdict"] == "fail"
    seg = {s["id"]: s for s in rep["segments"]}
    # Which x-vector clones share an engine step with the in-context one depends on timing (a loaded
    # machine forms other batches): every one that got a reference got hm-11's, and at least one did.
    leaked = [sid for sid in ("hm-09-en-xvector-aligned", "hm-10-en-xvector-unaligned", "hm-12-en-same-text-xvector")
              if seg[sid]["verdict"] == "contamination"]
    assert any(s["verdict"] == "contamination" and s["donor"] for s in seg.values()), list(seg.values())
    for sid in leaked:
        s = seg[sid]
        assert (s["verdict"], s["stage"], s["donor"], s["donor_kind"], s["first_divergent_chunk"]) == (
            "contamination", "handoff", "hm-11-en-same-text-icl", "codes", 0), s
        # what the capture says the vocoder got is the donor's own reference, as its talker was prompted
        cand = read_result(next((run / "ref-leak-4373" / "results" / "candidate-c4").glob(f"{sid}.*.json")))
        donor = read_result(next((run / "ref-leak-4373" / "results" / "candidate-c4").glob("hm-11-*.json")))
        assert np.array_equal(cand.ref_codes, donor.extra["talker_ref_codes"])
        assert cand.extra["talker_ref_codes"].shape == (0, 16)  # its own talker had none
    # at concurrency 1 the leak is gone (it needs a co-batched request); what stays is the release's own
    # float-ceil padding of hm-06-es (cases/bugs/prompt-len-float-ceil)
    at_one = {s["id"]: s["verdict"] for s in rep["at_concurrency_1"]["segments"]}
    assert at_one.pop("hm-06-es") == "talker_defect"
    assert set(at_one.values()) <= {"identical", "numeric_drift", "code_divergence"}, at_one


def test_the_reference_left_in_the_output_is_a_handoff_defect(corpus_run):
    """#4421 re-created: no trim length travels with the reference prefix."""
    rep = _report(corpus_run[2], "no-async-trim-4429")
    assert rep["verdict"] == "fail" and rep["at_concurrency_1"]["verdict"] == "fail"  # no concurrency needed
    for s in rep["segments"]:
        assert (s["verdict"], s["stage"], s["first_divergent_chunk"]) == ("handoff_defect", "handoff", 0), s
        stage = s["comparisons"]["talker_stage"]
        assert stage["handed_frames"] == stage["talker_frames"] + stage["talker_ref_frames"]


def test_a_prompt_length_estimate_fallback_is_a_talker_defect(corpus_run):
    """#1553 re-created: the in-context prompt is reserved 2048 positions, whatever it holds."""
    rep = _report(corpus_run[2], "prompt-len-fallback-1554")
    assert rep["verdict"] == "fail"
    for s in rep["segments"]:
        assert (s["verdict"], s["stage"]) == ("talker_defect", "talker"), s
        stage = s["comparisons"]["talker_stage"]
        assert stage["prompt_reserved"] == 2048 and stage["prompt_built"] < 100


def test_the_release_itself_pads_a_whole_frame_reference_and_nothing_else_fails(corpus_run):
    """A finding about 0.30.0 (no patch): 53760 samples are 28 frames, its float ceil reserves 29.
    The same run is the calibration: on the unmodified release no other segment may fail."""
    rep = _report(corpus_run[2], "prompt-len-float-ceil")
    seg = {s["id"]: s for s in rep["segments"]}
    s = seg.pop("hm-06-es")
    assert (s["verdict"], s["stage"]) == ("talker_defect", "talker")
    stage = s["comparisons"]["talker_stage"]
    assert stage["prompt_reserved"] == stage["prompt_built"] + 1 and stage["talker_ref_frames"] == 28
    assert {v["verdict"] for v in seg.values()} <= {"identical", "numeric_drift", "code_divergence"}, seg
