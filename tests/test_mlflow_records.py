"""What `difftest log` records, computed from report.json alone (no MLflow needed)."""

import math

from difftest.records import mlflow_records as rec
from difftest.verdicts.where import donor_text, where

# The layout `difftest run` writes (difftest/run.py, difftest/vllm_omni.py), trimmed.
RUN_REPORT = {
    "format": "difftest.report/1", "difftest_version": "0.1.0", "verdict": "fail", "concurrency": 4,
    "suite": {"name": "smoke", "path": "/s.yaml", "hash": "5" * 64, "segments": 2},
    "reference": {"label": "qwen-tts", "fingerprint": {"dtype": "float32"},
                  "provenance": {"engine": "qwen-tts", "versions": {"qwen-tts": "0.1.1", "torch": "2.9.0"},
                                 "device": "cpu", "models": {"base": {"sha256": "ab" * 32, "path": "/m"}},
                                 "commit": "difftestcommit"}},
    "candidate": {"label": "vllm-omni 0.30.0", "engine": "vLLM-Omni 0.30.0 on vLLM 0.30.1",
                  "versions": {"vllm_omni": "0.30.0", "vllm": "0.30.1", "torch": "2.10.0"}, "device": "cuda",
                  "deploy_overlay": "/out/deploy.yaml", "batches": [["s0", "s1"]] * 50},
    "provenance": {"difftest": "0.1.0", "timings": {"total_s": 12.5, "reference_s": 3.0}},
    "policy": {"tiers": {"close_max_abs": 0.001}, "require": {"drift": "close"}, "fail_on": ["error"]},
    "counts": {"identical": 1, "contamination": 1}, "failing": ["s1"], "segments": [],
}


def test_canonical_tags_from_a_run_report():
    t = rec.canonical_tags(RUN_REPORT)
    assert t == {
        "candidate.label": "vllm-omni 0.30.0", "candidate.version": "0.30.0", "vllm_omni.version": "0.30.0",
        "vllm.version": "0.30.1", "qwen_tts.version": "0.1.1", "torch.version": "2.10.0", "device": "cuda",
        "checkpoint.sha256": "ab" * 32, "deploy_config": "/out/deploy.yaml", "suite.name": "smoke",
        "suite.hash": "5" * 64, "concurrency": "4", "verdict": "fail", "difftest.version": "0.1.0"}
    tags = rec.parent_tags(RUN_REPORT, "f" * 64, {"gate": "nightly"})
    assert tags["reference.provenance.commit"] == "difftestcommit" and tags["candidate.versions.vllm"] == "0.30.1"
    assert not any(k.startswith("candidate.batches") for k in tags)
    assert (tags[rec.KIND], tags[rec.REPORT_SHA], tags["gate"]) == ("run", "f" * 64, "nightly")
    assert all(len(k) <= rec.MAX_KEY and len(v) <= rec.MAX_TAG_VALUE for k, v in tags.items())
    m = rec.parent_metrics(RUN_REPORT)
    assert (m["count.contamination"], m["count.identical"], m["count.vocoder_defect"], m["failing"], m["pass"]) == (
        1, 1, 0, 1, 0)
    assert m["timing.total_s"] == 12.5
    assert rec.experiment_name(RUN_REPORT) == "difftest/smoke" and rec.experiment_name({"suite": None}) == "difftest/adhoc"


def test_the_measured_null_beside_the_candidate():
    null = {"verdict": "talker_defect", "sites": {
        "talker": {"p_value": 0.3, "candidate": {"rate": 0.02}, "null": {"rate": 0.01}},
        "code_predictor": {"p_value": 0.001, "candidate": {"rate": 0.05}, "null": {"rate": 0.02}}}}
    m = rec.parent_metrics({**RUN_REPORT, "measured_null": null})
    assert {k: v for k, v in m.items() if k.startswith("null.")} == {
        "null.talker.p_value": 0.3, "null.talker.candidate_rate": 0.02, "null.talker.null_rate": 0.01,
        "null.code_predictor.p_value": 0.001, "null.code_predictor.candidate_rate": 0.05,
        "null.code_predictor.null_rate": 0.02, "null.pass": 0.0}
    assert not any(k.startswith("null.") for k in rec.parent_metrics(RUN_REPORT))
    at_n = {"verdict": "concurrency_defect", "sites": {"talker": {"p_value": 0.5, "candidate": {"rate": 0.01}}},
            "flips": {"candidate": 3, "null": 0, "p_value": 0.216, "width_p_value": 1.0}}
    m = rec.parent_metrics({**RUN_REPORT, "measured_null_at_n": at_n})
    assert {k: v for k, v in m.items() if k.startswith("null_n.")} == {
        "null_n.talker.p_value": 0.5, "null_n.talker.candidate_rate": 0.01, "null_n.flips.candidate": 3.0,
        "null_n.flips.null": 0.0, "null_n.flips.p_value": 0.216, "null_n.flips.width_p_value": 1.0, "null_n.pass": 0.0}


def test_missing_facts_are_left_out():
    t = rec.canonical_tags({"verdict": "pass", "candidate": {"label": "x"}, "suite": None})
    assert t == {"candidate.label": "x", "verdict": "pass"}


def test_segment_metrics_steps_tiers_and_caps():
    seg = {"id": "s0", "verdict": "numeric_drift", "comparisons": {
        "audio": {"tiers": ["identical", "close"], "chunks": {"max_abs": [0.0, 1e-4], "snr_db": [math.inf, 80.0],
                                                             "rms": [0.0, math.nan], "logmel": [0.0, 0.01]}},
        "codes": {"chunk_agreement": [1.0, 0.5]}, "donor_search": {"own_logmel": 1.0, "chunks": [1]}}}
    got = {(n, s): v for n, v, s in rec.segment_metrics(seg)}
    assert len(got) == 2 + 2 + 2 + 2 + 1 + 2  # max_abs, snr_db, logmel, tier, rms (one NaN dropped), agreement
    assert got[("audio.snr_db", 0)] == 100.0 and ("audio.rms", 1) not in got
    assert [got[("audio.tier", i)] for i in (0, 1)] == [0.0, 2.0]
    assert [got[("codes.chunk_agreement", i)] for i in (0, 1)] == [1.0, 0.5]
    assert not any(n.startswith("donor_search") for n, _ in got)
    assert rec.finite("x.max_abs", -math.inf) == -rec.METRIC_CAP and rec.finite("x", "n/a") is None


def test_only_segments_that_are_not_clean_get_a_child_run_and_every_one_a_row_with_its_worst_chunk():
    segs = [{"id": "a", "verdict": "identical", "comparisons": {"codes": {"chunk_agreement": [1.0, 1.0]}}},
            {"id": "b", "verdict": "numeric_drift", "comparisons": {
                "audio": {"tiers": ["identical", "close"], "chunks": {"max_abs": [0.0, 1e-4], "snr_db": [math.inf, 80.0],
                                                                     "logmel": [0.0, 0.01]}}}},
            {"id": "c", "verdict": "contamination", "first_divergent_chunk": 1, "stage": "handoff", "comparisons": {
                "audio": {"tiers": ["close", "diverged"], "chunks": {"max_abs": [1e-4, 0.3], "snr_db": [70.0, 2.0],
                                                                     "logmel": [0.0, 1.5]}},
                "codes": {"chunk_agreement": [1.0, 0.25]}}}]
    report = {"segments": segs, "failing": ["c"]}
    assert [rec.has_child_run(s) for s in segs] == [False, False, True]
    rows = {r["segment"]: r for r in rec.segment_rows(report)}
    assert (rows["a"]["child_run"], rows["a"]["codes.chunk_agreement"], rows["a"]["audio.max_abs"]) == (False, 1.0, None)
    assert (rows["b"]["audio.max_abs"], rows["b"]["audio.snr_db"], rows["b"]["audio.tier"]) == (1e-4, 80.0, 2)
    assert (rows["c"]["failing"], rows["c"]["first_divergent_chunk"], rows["c"]["audio.snr_db"]) == (True, 1, 2.0)
    assert rec.worst_metrics(report) == {"worst.audio.max_abs": 0.3, "worst.audio.snr_db": 2.0, "worst.audio.logmel": 1.5,
                                         "worst.audio.tier": 3, "worst.codes.chunk_agreement": 0.25}


def test_batches_stay_within_mlflow_limits():
    metrics, tags, params = list(range(2500)), [f"t{i}" for i in range(250)], [f"p{i}" for i in range(30)]
    got = list(rec.batches(metrics, tags, params))
    for m, p, t in got:
        assert len(m) <= 1000 and len(p) + len(t) <= 100 and len(m) + len(p) + len(t) <= 1000
    assert [x for m, _, _ in got for x in m] == metrics
    assert [x for _, _, t in got for x in t] == tags and [x for _, p, _ in got for x in p] == params


def test_divergence_rows_skip_clean_segments():
    report = {"failing": ["s1"], "segments": [
        {"id": "s0", "verdict": "identical"}, {"id": "s1", "verdict": "contamination", "donor": "s2",
                                               "first_divergent_chunk": 0, "stage": "handoff", "summary": "x"},
        {"id": "s2", "verdict": "code_divergence", "summary": "y"}]}
    report["segments"][1]["donor_kind"] = "length"
    rows = rec.divergence_rows(report)
    assert [(r["segment"], r["failing"], r["donor"], r["donor_kind"]) for r in rows] == [
        ("s1", True, "s2", "length"), ("s2", False, None, None)]
    tags = rec.segment_tags(report["segments"][1], report, "p" * 32, {})
    assert (tags["donor"], tags["donor_kind"]) == ("s2", "length")
    assert "donor_kind" not in rec.segment_tags(report["segments"][2], report, "p" * 32, {})


def test_donor_text_and_where_one_formatter_for_every_output():
    assert donor_text({"donor": None}) == "" and donor_text({}) == ""
    assert donor_text({"donor": "s2"}) == "s2" and donor_text({"donor": "s2", "donor_kind": "codes"}) == "s2"
    assert donor_text({"donor": "s2", "donor_kind": "length"}) == "s2 (length)"
    seg = {"id": "s0", "verdict": "contamination", "first_divergent_chunk": 0, "stage": "handoff", "donor": "s2",
           "donor_kind": "length"}
    assert where(seg) == "chunk 0, handoff, donor s2 (length)"
    assert where(seg, stage_word=True) == "chunk 0, stage handoff, donor s2 (length)"
    assert where({"first_divergent_chunk": None}) == ""
    from difftest.bisect.probe import describe  # bisect's record used to drop "(length)"

    assert describe(seg) == "s0 contamination (chunk 0, stage handoff, donor s2 (length))"
