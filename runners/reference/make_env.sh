#!/usr/bin/env bash
# Create the reference runner's environment: the official qwen-tts 0.1.1 with
# its pinned transformers, a CPU torch, and this repo (no deps) on top.
#
#   runners/reference/make_env.sh [VENV_DIR]        (default: <repo>/.venv-reference)
#
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, a CPU
# build here); on a GPU host, e.g. TORCH_SPEC="torch==2.14.1". PYTHON picks the
# interpreter that creates the venv (default python3).
#
# Idempotent: a stamp file records what was installed; when it matches and the
# environment still imports, the script exits at once.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.venv-reference}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
qwen_spec="qwen-tts==0.1.1"
python="${PYTHON:-python3}"

say() { echo "[make_env] $*" >&2; }

# Everything that decides the installed set; a change of any of it reinstalls.
want="$(printf '%s\n' "$torch_spec" "$qwen_spec" "$repo" && cat "$here/requirements.txt")"
want_sum="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
stamp="$venv/.difftest-reference-env"

check_imports() {
    # qwen_tts itself is not imported (7 s); its presence and the imports it needs are checked.
    "$venv/bin/python" - <<'EOF'
import importlib.metadata as md, importlib.util as u
for mod in ("torch", "transformers", "accelerate", "librosa", "soundfile", "sox", "onnxruntime",
            "einops", "numpy", "yaml", "difftest", "runners.reference"):
    if u.find_spec(mod) is None:
        raise SystemExit(f"missing module {mod}")
assert md.version("qwen-tts") == "0.1.1", md.version("qwen-tts")
EOF
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want_sum" ]] && check_imports 2>/dev/null; then
    say "up to date: $venv ($torch_spec, $qwen_spec)"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    say "creating venv $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
else
    say "reusing venv $venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# uv where scripts/lib.sh set it up (uv_setup: the same sources as pip, several times faster)
[[ -n "${DIFFTEST_UV:-}" ]] && pip=("$DIFFTEST_UV" pip install -q --python "$venv/bin/python")

say "installing $torch_spec"
"${pip[@]}" "$torch_spec"
say "installing runners/reference/requirements.txt"
"${pip[@]}" -r "$here/requirements.txt" "$torch_spec"
say "installing $qwen_spec (--no-deps: its declared torchaudio/gradio are not wanted)"
"${pip[@]}" --no-deps "$qwen_spec"

# A torchaudio that cannot load (the PyPI wheel is a CUDA build) is worse than
# none: runners/reference/torchaudio_stub.py stands in only when none imports.
if "$venv/bin/python" -c "import importlib.util as u; exit(u.find_spec('torchaudio') is None)" 2>/dev/null \
   && ! "$venv/bin/python" -c "import torchaudio.compliance.kaldi" 2>/dev/null; then
    say "removing a torchaudio that does not import"
    "$venv/bin/python" -m pip uninstall -y torchaudio
fi

say "installing this repo (editable, no deps) with numpy and PyYAML"
"${pip[@]}" numpy PyYAML
# The lock: every environment installs this repository editable, and two such installs at once
# race on its difftest.egg-info (scripts/test.sh starts them side by side).
mkdir -p "$repo/.cache"
{ flock 9; "${pip[@]}" --no-deps -e "$repo"; } 9> "$repo/.cache/editable-install.lock"

check_imports
# librosa's numba kernels compile on first use (about 20 s) and cache into
# site-packages; pay that here rather than in the first runner.
say "warming librosa's numba cache"
"$venv/bin/python" - <<'PY'
import os, tempfile
import numpy as np, soundfile as sf, librosa
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "tone.wav")
    sf.write(path, (0.1 * np.sin(np.arange(2400) / 4)).astype(np.float32), 24000, subtype="PCM_16")
    librosa.load(path, sr=None, mono=True)
PY
printf '%s' "$want_sum" > "$stamp"
say "ready: $venv"
"$venv/bin/python" -c "import importlib.metadata as md; print(' '.join(f'{p}=={md.version(p)}' for p in ('qwen-tts','transformers','torch','numpy')))" >&2
