#!/usr/bin/env bash
# The main job on this CPU machine: the real vLLM-Omni 0.30.0 server against the official qwen-tts,
# then the negative control. Installs what it needs first (minutes the first time; seconds after).
#   1. qwen-tts 0.1.1 (the reference) on the seeded tiny checkpoint, at concurrency 1;
#   2. vLLM-Omni 0.30.0 (vllm serve --omni, difftest's CPU platform) on the same checkpoint, at
#      concurrency 1 and 4: its verdicts, report.json, MLflow;
#   3. the negative control: the difftest CPU test engine (NOT vLLM-Omni) with the seed's bug planted
#      (ref-leak), which difftest must catch: contamination, the onset chunk, stage and donor.
# Safe to re-run: environments and the reference results are reused, and candidate results made by
# the same engine and configuration (--replace recomputes them when the engine or its code changed).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
OUT=${DEMO_OUT:-demo-out}
DT=.venv/bin/difftest

echo "== installing side by side (cold: about 2 min with uv, 7 with pip; the vLLM-Omni environment is most of it)"
system_packages run || exit 1  # Debian's libsndfile1 (scripts/system-packages.txt)
uv_setup  # DIFFTEST_UV: the installs use uv (pip where it cannot be had)
install_bg tester install_tester '.[mlflow]'
install_bg reference bash runners/reference/make_env.sh
install_bg vllm-omni bash runners/vllm_omni/make_env.sh
wait_installs || exit 1

set +e
echo; echo "== 1/2: vLLM-Omni 0.30.0 (the real server, on difftest's CPU platform) at concurrency 4"
echo "        against qwen-tts 0.1.1 at concurrency 1"
$DT run cases/suites/smoke.yaml --candidate vllm-omni --concurrency 4 --out "$OUT/vllm-omni-0.30.0" --replace
real=$?
echo; echo "== 2/2: negative control: the difftest CPU test engine (not vLLM-Omni) with the seed's ref-leak planted"
$DT run cases/suites/smoke.yaml --candidate cpu-engine:ref-leak --concurrency 4 --out "$OUT/negative-control-ref-leak" --replace
leak=$?
.venv/bin/python scripts/check_control.py ref-leak "$OUT/negative-control-ref-leak"
caught=$?
set -e
echo
case $real in
    0) echo "vLLM-Omni 0.30.0: pass (exit 0)" ;;
    1) echo "vLLM-Omni 0.30.0: FAIL (exit 1): divergences the policy fails; see the report" ;;
    *) echo "vLLM-Omni 0.30.0: no verdict (exit $real: 2 bad input, 3 infrastructure)" ;;
esac
echo "negative control (CPU test engine + ref-leak): exit $leak (1 expected), $([ $caught = 0 ] && echo caught || echo NOT CAUGHT)"
echo "reports: $OUT/vllm-omni-0.30.0/report.json $OUT/negative-control-ref-leak/report.json"
echo "MLflow: .venv/bin/mlflow ui --backend-store-uri sqlite:///$(pwd)/mlflow.db   then open http://127.0.0.1:5000"
[ "$real" -le 1 ] && [ "$leak" = 1 ] && [ "$caught" = 0 ]
