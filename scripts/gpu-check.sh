#!/usr/bin/env bash
# The whole GPU path in one command, on a fresh GPU host (README, "On a GPU host"):
#   1. is there a GPU? If not: one JSON line {"ok": false, "error": ...} and exit 3, within seconds;
#   2. installs from the package registries, side by side: the tester (.venv), the reference
#      (.venv-reference: qwen-tts 0.1.1 on PyPI's CUDA torch), vLLM-Omni (.venv-vllm-omni:
#      make_env.sh --device cuda, vllm 0.30.0 from PyPI and the capture plugin);
#   3. difftest run on the seeded tiny checkpoints (built on first use), everything on the GPU: the
#      reference at concurrency 1, the real vLLM-Omni server at 1 and 4 on the same GPU, cross-decodes,
#      teacher-forced scoring, report.json, MLflow (sqlite in OUT), while every process's GPU memory
#      is sampled once a second;
#   4. one JSON summary on stdout (also OUT/gpu-check.json): versions, devices, dtypes and eagerness,
#      the verdicts at 1 and 4, timings, installs, GPU memory peak per process, and the capture's
#      fields with the model runner that wrote them (v1, or the deploy's default v2), and what the
#      GPU's numerics did to the allowances measured on the CPU (`numerics`: the assembled prompt's
#      worst row against float32 qwen-tts's, the measured null's noise model);
#
#   bash scripts/gpu-check.sh [OUT]          default OUT: .cache/gpu-check
#   GPU_CHECK_SUITE=cases/suites/X.yaml      another suite (default smoke: one server, 4 segments)
#   GPU_CHECK_ARGS="--enforce-eager ..."     more `difftest run` arguments (e.g. --batch-invariant)
#
# Progress goes to stderr; stdout holds only the summary. Exit: 0 the path ran and the verdict is a
# pass, 1 it ran and found divergences, 3 no GPU, an install failed, the run gave no verdict, or a
# capture file lacks the talker's input, prompt rows, assembled prompt or top-k (the field named on
# stderr and in the summary's `error`: a verdict reached without them is not the GPU path checked).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache/gpu-check}
SUITE=${GPU_CHECK_SUITE:-cases/suites/smoke.yaml}
PY=${PYTHON:-python3}

fail() {  # MESSAGE: the one JSON line, and exit 3
    "$PY" -c 'import json, sys; print(json.dumps({"ok": False, "error": sys.argv[1]}))' "$1"
    echo "gpu-check: $1" >&2
    exit 3
}

# 1. the GPU, before anything is installed (PYTHONPATH: the tester is not installed yet)
gpus=$(PYTHONPATH=. "$PY" -m difftest.commands.gpucheck gpus 2>&1) || fail "$gpus (this script needs a GPU host)"
echo "gpu-check: $(echo "$gpus" | head -n 1)$( [ "$(echo "$gpus" | wc -l)" -gt 1 ] && echo " (+ $(( $(echo "$gpus" | wc -l) - 1 )) more)")" >&2

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
t0=$SECONDS
(
    source scripts/lib.sh
    echo "== installing side by side (cold: several GB of CUDA wheels)"
    install_bg tester install_tester '.[mlflow]'
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} install_bg reference bash runners/reference/make_env.sh
    install_bg vllm-omni bash runners/vllm_omni/make_env.sh --device cuda
    wait_installs || exit 3
) >&2 || fail "an install failed (logs: .cache/logs/install-*.log)"
echo "installs $((SECONDS - t0))" > "$OUT/installs.txt"

# 3. the run, with the GPU memory sampled beside it
rm -f "$OUT/gpu-memory.jsonl"
.venv/bin/python -m difftest.commands.gpucheck sample "$OUT/gpu-memory.jsonl" & sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
t1=$SECONDS
set +e
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of arguments
.venv/bin/difftest run "$SUITE" --candidate vllm-omni --reference-device cuda:0 --concurrency 4 \
    --out "$OUT/run" --store "$OUT/store" --replace --tracking-uri "sqlite:///$OUT/mlflow.db" \
    ${GPU_CHECK_ARGS:-} >&2
rc=$?
set -e
kill $sampler 2>/dev/null || true
wait $sampler 2>/dev/null || true

# 4. the summary (difftest.commands.gpucheck: not ok, naming the missing capture field, when the talker's
#    input, prompt rows, assembled prompt or top-k are absent from a capture file)
summary_rc=0
.venv/bin/python -m difftest.commands.gpucheck summary "$OUT/run" --samples "$OUT/gpu-memory.jsonl" \
    --installs "$OUT/installs.txt" --wall $((SECONDS - t1)) > "$OUT/gpu-check.json" || summary_rc=$?
cat "$OUT/gpu-check.json"
case $rc in
    0|1) ;;
    *) echo "gpu-check: difftest run gave no verdict (exit $rc); logs in $OUT/run/logs" >&2; exit 3 ;;
esac
if [ "$summary_rc" -ne 0 ]; then
    echo "gpu-check: the summary is not ok (its \"error\" above); exit 3" >&2
    exit 3
fi
exit $rc
