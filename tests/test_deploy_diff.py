"""What a run serves against the release's own deploy file (difftest.engines.deploy_diff): the
differences with their reasons, in report.json, MLflow and the dashboard, and a gate cell's
`production:` requirement. Overlays are computed, no server is started; the release file is the
real one of .venv-vllm-omni (vLLM-Omni 0.30.0)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from difftest.engines import deploy_diff as dd
from difftest.engines import vllm_omni as vo
from difftest.engines.engine_args import parse
from difftest.errors import BadInput

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "cases" / "suites" / "smoke.yaml"


@pytest.fixture(scope="module")
def env_info():
    return vo.environment_info(vo.omni_python())


@pytest.fixture(scope="module")
def release(env_info) -> Path:
    path = dd.release_deploy(env_info).resolve()
    assert path.is_file(), path
    return path


def served(release: Path, tmp_path: Path, texts=(), **opts) -> tuple[dict, vo.VllmOmniOptions]:
    """report.json's `configuration` for the overlay `difftest run` writes with these --engine-args."""
    top, stages = parse(texts)
    options = vo.VllmOmniOptions(max_num_seqs=4, deploy_overrides=top, stage_overrides=stages, **opts)
    base = Path(options.deploy_base) if options.deploy_base else release  # as vllm_omni._prepare
    path = vo.write_overlay(tmp_path / "deploy-overlay.yaml", vo.deploy_overlay(base, options))
    return dd.served_configuration({"deploy_dir": str(release.parent)}, path, options), options


def by_key(config: dict) -> dict:
    return {d["key"]: d for d in config["differences"]}


def test_the_default_cpu_run_states_each_difference_from_the_release_with_its_reason(release, tmp_path):
    config, _ = served(release, tmp_path)
    assert config["production"] == str(release) and config["device"] == "cpu"
    assert "no CPU deploy" in config["note"] and "error" not in config
    diffs = by_key(config)
    assert {k: (d["production"], d["served"]) for k, d in diffs.items() if k in {
        "talker.max_model_len", "talker.async_scheduling", "vocoder.async_scheduling", "async_chunk",
        "vocoder.dtype", "model_runner", "talker.default_sampling_params.temperature",
        "talker.default_sampling_params.top_k", "talker.subtalker_sampling_params.do_sample",
        "vocoder.enforce_eager", "talker.max_num_seqs", "talker.default_sampling_params.top_p"}} == {
        "talker.max_model_len": (4096, 2048), "talker.async_scheduling": (True, False),
        "vocoder.async_scheduling": (True, False), "async_chunk": (True, False),
        "vocoder.dtype": ("bfloat16", "float32"), "model_runner": ("v2", "v1"),
        "talker.default_sampling_params.temperature": (0.9, 0.0), "talker.default_sampling_params.top_k": (50, -1),
        "talker.subtalker_sampling_params.do_sample": (True, False), "vocoder.enforce_eager": (False, True),
        "talker.max_num_seqs": (64, 4),
        "talker.default_sampling_params.top_p": (None, 1.0)}  # not set in the release: null
    for d in config["differences"]:  # every one with a reason of difftest's own, none left unexplained
        assert d["why"] and d["why"] != "no reason recorded" and not d["why"].startswith("set by"), d
    assert diffs["model_runner"]["why"] == "CPU: v2 cannot run on the CPU platform (requests hang)"
    assert diffs["talker.enforce_eager"]["why"] == "CPU: no CUDA graphs"
    assert "vllm/platforms/cpu.py" in diffs["talker.async_scheduling"]["why"]
    assert diffs["talker.default_sampling_params.temperature"]["why"].startswith("greedy for a code-exact comparison")
    # what both files say alike is not listed: the talker's step budget, the repetition penalty, min_tokens, the connectors
    assert not {"talker.max_num_batched_tokens", "talker.default_sampling_params.repetition_penalty",
                "talker.default_sampling_params.min_tokens",
                "connectors.connector_of_shared_memory.extra.codec_chunk_frames", "talker.devices"} & set(diffs)
    keys = [d["key"] for d in config["differences"]]  # top level, then talker, then vocoder, each by key
    assert keys == sorted(keys, key=lambda k: ({"talker": 1, "vocoder": 2}.get(k.split(".")[0], 0), k))
    json.dumps(config, allow_nan=False)


def test_a_gpu_run_differs_by_placement_decoding_and_the_captured_vocoder_only(release, tmp_path):
    config, _ = served(release, tmp_path, device="cuda", gpus=(0,))
    diffs = by_key(config)
    assert "note" not in config
    assert not {"model_runner", "talker.async_scheduling", "talker.max_num_batched_tokens",
                "talker.enforce_eager"} & set(diffs)
    assert diffs["vocoder.enforce_eager"]["served"] is True
    assert diffs["talker.gpu_memory_utilization"]["production"] == 0.3
    assert "capture" in diffs["vocoder.enforce_eager"]["why"]
    assert diffs["talker.gpu_memory_utilization"]["why"].startswith("placement")


def test_an_engine_arg_at_productions_value_removes_the_difference_and_others_say_who_set_them(release, tmp_path):
    config, _ = served(release, tmp_path, ["talker.max_model_len=4096", "vocoder.dtype=bfloat16",
                                           "talker.enable_prefix_caching=true", "talker.max_num_seqs=8"])
    diffs = by_key(config)
    assert "talker.max_model_len" not in diffs and "vocoder.dtype" not in diffs
    assert diffs["talker.enable_prefix_caching"] == {"key": "talker.enable_prefix_caching", "production": False,
                                                     "served": True, "why": "set by --engine-arg"}
    assert (diffs["talker.max_num_seqs"]["served"], diffs["talker.max_num_seqs"]["why"]) == (8, "set by --engine-arg")
    assert diffs["vocoder.max_num_seqs"]["why"].startswith("the run's concurrency")  # difftest's, not the user's


def test_a_started_server_reports_its_configuration(release, env_info, tmp_path, monkeypatch):
    """start_vllm_omni's provenance carries the differences (the servers stubbed: no model work)."""
    from contextlib import ExitStack

    class Stub:
        def __init__(self, argv, url, log, **kw):
            self.url, self.log_path, self.started_s = url, log, 0.1

    monkeypatch.setattr(vo, "ServerProcess", Stub)
    monkeypatch.setattr(vo, "start_together", lambda procs, stack: None)
    monkeypatch.setattr(vo, "environment_info", lambda python: {**env_info, "difftest_capture": "x",
                                                                "difftest_cpu_platform": "x"})
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"tts_model_type": "base"}))
    top, stages = parse(["talker.enable_prefix_caching=true"])
    with ExitStack() as stack:
        _, _, info = vo.start_vllm_omni(tmp_path / "run", [str(model)], vo.VllmOmniOptions(
            deploy_overrides=top, stage_overrides=stages), stack, tasks={"voice_clone"})
    config = info["served_configuration"]
    assert config["production"] == str(release) and config["served"].endswith("vllm-omni/deploy-overlay.yaml")
    assert by_key(config)["talker.enable_prefix_caching"]["why"] == "set by --engine-arg"
    assert by_key(config)["model_runner"]["served"] == "v1"


def test_a_deploy_config_of_ones_own_is_still_compared_with_the_release(release, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"base_config: {release}\nconnectors:\n  connector_of_shared_memory:\n    extra:\n"
                    f"      codec_chunk_frames: 50\nstages:\n  - stage_id: 1\n    some_vllm_knob: 3\n")
    config, _ = served(release, tmp_path, deploy_base=str(mine))
    diffs = by_key(config)
    assert config["production"] == str(release) and config["deploy_config"] == str(mine)
    assert diffs["connectors.connector_of_shared_memory.extra.codec_chunk_frames"] == {
        "key": "connectors.connector_of_shared_memory.extra.codec_chunk_frames", "production": 25, "served": 50,
        "why": f"set by --deploy-config {mine}"}
    assert diffs["vocoder.some_vllm_knob"]["why"] == f"set by --deploy-config {mine}"
    assert "connectors.connector_of_shared_memory.extra.codec_left_context_frames" not in diffs  # merged, kept
    assert diffs["model_runner"]["why"].startswith("CPU: v2")  # difftest's own settings keep their reasons


def test_a_setting_without_a_recorded_reason_is_listed_as_such(tmp_path):
    prod, srv = tmp_path / "p.yaml", tmp_path / "s.yaml"
    prod.write_text("stages:\n  - {stage_id: 0, foo: 1}\n  - {stage_id: 2, bar: x}\n")
    srv.write_text(f"base_config: {prod.name}\nstages:\n  - {{stage_id: 0, foo: 2}}\n  - {{stage_id: 2, bar: y}}\n")
    assert dd.differences(prod, srv, "cpu") == [
        {"key": "talker.foo", "production": 1, "served": 2, "why": "no reason recorded"},
        {"key": "stage2.bar", "production": "x", "served": "y", "why": "no reason recorded"}]


# vLLM-Omni's own reading of a deploy file (resolve_deploy_yaml, load_deploy_config, _apply_platform_overrides),
# each stage as the fields and engine_extras it ends up with.
_REAL = r"""
import dataclasses, json, sys
from vllm_omni.config.stage_config import load_deploy_config, _apply_platform_overrides
out = {}
for platform in sys.argv[2:]:
    d = _apply_platform_overrides(load_deploy_config(sys.argv[1]), platform=platform)
    stages = {}
    for s in d.stages:
        f = {k: v for k, v in dataclasses.asdict(s).items() if k != "engine_extras"}
        stages[str(s.stage_id)] = {**f, **s.engine_extras}
    out[platform] = {"model_runner": d.model_runner, "async_chunk": d.async_chunk, "connectors": d.connectors,
                     "stages": stages}
print(json.dumps(out, default=str))
"""


def test_files_are_read_as_vllm_omni_itself_reads_them(release, tmp_path):
    """base_config inheritance (stages by stage_id, the sampling dicts deep-merged, env replaced,
    connectors merged), nested engine_args/runtime, and each platform's section, against vLLM-Omni
    0.30.0's own loader run in its environment."""
    base = tmp_path / "base.yaml"
    base.write_text(release.read_text() + """
  cuda:
    model_runner: v1
    stages:
      - stage_id: 0
        env: {B: "2"}
        default_sampling_params: {top_k: 7}
      - stage_id: 1
        engine_args: {max_num_seqs: 5}
        runtime: {devices: "1"}
""")
    overlay = tmp_path / "sub" / "overlay.yaml"
    overlay.parent.mkdir()
    overlay.write_text("""base_config: ../base.yaml
async_chunk: false
connectors: {connector_of_shared_memory: {extra: {codec_chunk_frames: 30}}}
stages:
  - stage_id: 0
    env: {A: "1"}
    default_sampling_params: {temperature: 0.0}
    engine_args: {max_model_len: 1024}
  - stage_id: 1
    runtime: {devices: "0"}
    max_num_batched_tokens: 4096
platforms:
  rocm:
    stages:
      - {stage_id: 0, max_num_seqs: 3}
""")
    platforms = ["cuda", "rocm", "npu", "cpu"]
    r = subprocess.run([str(vo.omni_python()), "-c", _REAL, str(overlay), *platforms], capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    real = json.loads(r.stdout.strip().splitlines()[-1])
    for platform in platforms:
        ours = dd.for_platform(dd.resolve(dd._read(overlay), overlay.parent), platform)
        theirs = real[platform]
        assert (ours["model_runner"], ours["async_chunk"], ours["connectors"]) == (
            theirs["model_runner"], theirs["async_chunk"], theirs["connectors"]), platform
        for st in ours["stages"]:
            mine = {k: v for k, v in st.items()}
            them = theirs["stages"][str(st["stage_id"])]
            assert {k: them.get(k) for k in mine} == mine, (platform, st["stage_id"])
            set_there = {k for k, v in them.items()
                         if v is not None and k not in ("num_replicas", "silence_ban_frames")}  # dataclass defaults
            assert set_there <= set(mine), (platform, set_there - set(mine))
    cuda = {s["stage_id"]: s for s in dd.effective(overlay, "cuda")["stages"]}  # what the loader made of it
    assert cuda[0]["env"] == {"A": "1", "B": "2"} and cuda[0]["max_model_len"] == 1024
    assert cuda[0]["default_sampling_params"]["temperature"] == 0.0 and cuda[0]["default_sampling_params"]["top_k"] == 7
    assert (cuda[1]["devices"], cuda[1]["max_num_seqs"], cuda[1]["max_num_batched_tokens"]) == ("1", 5, 4096)


def _gate(tmp_path: Path, cell: str, candidate: str = "vllm-omni") -> Path:
    gate = tmp_path / "gate.yaml"
    gate.write_text(f"candidates: [{candidate}]\ncells:\n  - {{name: a, suite: {SMOKE}, concurrency: 2, {cell}}}\n")
    return gate


def test_a_gate_cell_that_must_serve_productions_value_and_cannot_exits_2_before_any_cell_runs(tmp_path, capsys):
    from difftest.cli import main
    from difftest.commands.matrix import load_matrix

    with pytest.raises(BadInput) as e:
        load_matrix(_gate(tmp_path, "production: [talker.max_model_len]"))
    assert e.value.exit_code == 2
    assert ("cell a: production: talker.max_model_len must serve the release's value 4096" in str(e.value)
            and "the cell serves 2048 (CPU: sized for the tiny checkpoints" in str(e.value))
    out = tmp_path / "out"
    assert main(["matrix", str(_gate(tmp_path, "production: [async_chunk]")), "--out", str(out), "--no-mlflow"]) == 2
    assert "production: async_chunk must serve the release's value true" in capsys.readouterr().err
    assert not (out / "cells").exists()  # nothing ran

    # served as the release has it: the cell loads; a key under a prefix counts, stage numbers too
    m = load_matrix(_gate(tmp_path, "config: [async_chunk=true, talker.max_model_len=4096], "
                                    "production: [async_chunk, 0.max_model_len, talker.max_num_batched_tokens, connectors]"))
    assert m.cells[0]["production"] == ["async_chunk", "0.max_model_len", "talker.max_num_batched_tokens", "connectors"]
    with pytest.raises(BadInput, match="talker.default_sampling_params.temperature must serve the release's value 0.9"):
        load_matrix(_gate(tmp_path, "production: [talker.default_sampling_params]"))
    with pytest.raises(BadInput, match="'talker.max_num_batched_token' is no setting"):  # a typo never passes
        load_matrix(_gate(tmp_path, "production: [talker.max_num_batched_token]"))
    with pytest.raises(BadInput, match="serves no vLLM-Omni deploy file"):
        load_matrix(_gate(tmp_path, "production: [async_chunk]", candidate="cpu-engine"))
    with pytest.raises(BadInput, match=r"cells\[0\].production: expected a list"):
        load_matrix(_gate(tmp_path, "production: async_chunk"))


def test_report_mlflow_and_the_run_page_carry_the_differences(release, tmp_path, policy):
    from dashboards import pages
    from dashboards.gather import Run
    from difftest.records import mlflow_records as rec
    from difftest.records.report import build_report, check_report

    config, _ = served(release, tmp_path)
    report = json.loads(json.dumps(build_report([], policy, served_configuration=config)))
    assert check_report(report, "r")["configuration"] == config and build_report([], policy)["configuration"] is None
    broken = json.loads(json.dumps(report))
    del broken["configuration"]["differences"][0]["why"]
    with pytest.raises(BadInput, match=r"configuration.differences\[0\]"):
        check_report(broken, "r")

    tags = rec.parent_tags(report, "f" * 64)
    n = len(config["differences"])
    assert tags["configuration.differences"] == str(n)
    assert rec.parent_params(report)["configuration.differences"] == str(n)
    assert tags["configuration.production"] == str(release)
    assert tags["configuration.keys"].split(",")[:2] == [d["key"] for d in config["differences"][:2]]

    report["configuration"]["differences"][0]["why"] = "<b>x</b>"
    run = Run("r1", "1", "difftest/toy", "n", 0, {"verdict": "pass"}, {}, {**report, "segments": []}, "report.json",
              media={})
    page = pages.run_page(run, pages.Context(ui_url="http://x", uri="u", built="now"))
    assert "<h2>Served configuration</h2>" in page and page.count("<tr class=") >= n
    assert ("<td class=\"nowrap\"><code>talker.max_model_len</code></td><td>4096</td><td>2048</td>"
            in page)
    assert "<td>(not set)</td><td>1.0</td>" in page and "&lt;b&gt;x&lt;/b&gt;" in page


def test_the_differences_are_an_mlflow_artifact_and_a_count(release, tmp_path, mlflow_cwd):
    from mlflow import MlflowClient
    from mlflow_support import make_report

    from difftest.records.tracking import log_run

    out = make_report(tmp_path, "clean", segments=1)
    config, _ = served(release, tmp_path)
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps({**report, "configuration": config}))
    run_id = log_run(out)
    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    run = client.get_run(run_id)
    n = len(config["differences"])
    assert n >= 20 and run.data.tags["configuration.differences"] == str(n)
    assert run.data.params["configuration.differences"] == str(n)
    client.download_artifacts(run_id, "configuration.json", str(tmp_path))
    assert json.loads((tmp_path / "configuration.json").read_text()) == config
