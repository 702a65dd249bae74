#!/usr/bin/env bash
# The CPU demo: install what is needed, then run difftest's main job on the smoke suite.
#   1. qwen-tts (the reference) on the seeded tiny checkpoint, at concurrency 1;
#   2. the candidate at concurrency 1 and 4: the real vLLM-Omni server when its environment
#      (.venv-vllm-omni) is present, else the CPU test engine (not vLLM-Omni);
#   3. the negative control: the CPU test engine with the seed's bug planted (ref-leak), which
#      difftest must catch: contamination, the onset chunk, and the request it came from.
# Safe to re-run: environments, the reference results and finished candidate results are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${DEMO_OUT:-demo-out}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[mlflow]'
bash runners/reference/make_env.sh

if [ -x .venv-vllm-omni/bin/python ]; then CANDIDATE=vllm-omni; else CANDIDATE=cpu-engine; fi
DT=".venv/bin/difftest"
set +e
echo; echo "== 1/2: $CANDIDATE at concurrency 4 against qwen-tts at concurrency 1"
$DT run cases/suites/smoke.yaml --candidate "$CANDIDATE" --concurrency 4 --out "$OUT/clean"
clean=$?
echo; echo "== 2/2: the negative control: the CPU test engine with the seed's ref-leak planted"
$DT run cases/suites/smoke.yaml --candidate cpu-engine:ref-leak --concurrency 4 --out "$OUT/ref-leak"
leak=$?
set -e
echo
echo "exit codes: $CANDIDATE $clean (0 = pass), ref-leak $leak (1 = the divergence was caught)"
echo "reports: $OUT/clean/report.json $OUT/ref-leak/report.json"
echo "MLflow: .venv/bin/mlflow ui --backend-store-uri sqlite:///$(pwd)/mlflow.db   then open http://127.0.0.1:5000"
[ "$clean" = 0 ] && [ "$leak" = 1 ]
