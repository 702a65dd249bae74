# Shared by scripts/demo.sh and scripts/test.sh (sourced, not run).
#
# Installs take minutes and pip -q says nothing while it works, so they run side by side, each
# logging to .cache/logs/install-NAME.log, and every 20 s the console hears which are still
# running, for how long, and their latest step. A failed install shows its whole log.

declare -A _install_pid _install_start _install_epoch

install_bg() {  # NAME COMMAND...: start an install in the background
    local name=$1; shift
    mkdir -p .cache/logs
    "$@" > ".cache/logs/install-$name.log" 2>&1 &
    _install_pid[$name]=$!
    _install_start[$name]=$SECONDS
    _install_epoch[$name]=$(date +%s)
}

with_rc() {  # FILE COMMAND...: run it, then write its exit status to FILE (read by another process)
    local file=$1 rc=0; shift
    rm -f "$file"
    "$@" || rc=$?
    echo "$rc" > "$file.tmp" && mv "$file.tmp" "$file"
    return "$rc"
}

wait_installs() {  # [NAME...]: wait for these installs (default: every one started); non-zero when one failed
    local failed=0 spoke=$SECONDS name pid log
    local -a only=("$@")
    _pending() { if (( ${#only[@]} )); then for n in "${only[@]}"; do [[ -n ${_install_pid[$n]:-} ]] && echo "$n"; done
                 else printf '%s\n' "${!_install_pid[@]}"; fi; }
    while [[ -n $(_pending) ]]; do
        for name in $(_pending); do
            pid=${_install_pid[$name]}
            kill -0 "$pid" 2>/dev/null && continue
            log=".cache/logs/install-$name.log"
            if wait "$pid"; then
                # its log's last write is when it ended (it may be noticed later, after the tests)
                echo "== $name: ready in $(( $(stat -c %Y "$log") - _install_epoch[$name] )) s ($(tail -n 1 "$log"))"
            else
                echo "== $name: FAILED; its log ($log):"; cat "$log"; failed=1
            fi
            unset "_install_pid[$name]"
        done
        [[ -n $(_pending) ]] || break
        if (( SECONDS - spoke >= 20 )); then
            for name in "${!_install_pid[@]}"; do
                echo "   ... $name: $((SECONDS - _install_start[$name])) s so far; $(tail -n 1 ".cache/logs/install-$name.log" | cut -c1-110)"
            done
            spoke=$SECONDS
        fi
        sleep 1
    done
    return $failed
}

system_packages() {  # FOR...: install the Debian packages of scripts/system-packages.txt for these uses (run, test, ...)
    local want=() missing=() p use u _
    while read -r p use _; do
        [[ -z $p || $p == \#* ]] && continue
        for u in "$@"; do [[ $use == "$u" ]] && want+=("$p"); done
    done < scripts/system-packages.txt
    for p in "${want[@]}"; do
        [[ $(dpkg-query -W -f '${Status}' "$p" 2>/dev/null) == *" installed" ]] || missing+=("$p")
    done
    if (( ${#missing[@]} == 0 )); then
        echo "Debian packages ${want[*]}: installed"
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "this needs Debian packages a new machine lacks (scripts/system-packages.txt says why):" \
             "sudo apt-get install --no-install-recommends ${missing[*]}   then run this again" >&2
        return 1
    fi
    echo "installing Debian packages with apt-get (as root): ${missing[*]}"
    mkdir -p .cache/logs
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends "${missing[@]}"; } > .cache/logs/apt.log 2>&1; then
        cat .cache/logs/apt.log >&2
        echo "apt-get could not install ${missing[*]} (its log above: .cache/logs/apt.log)" >&2
        return 1
    fi
    echo "Debian packages ${want[*]}: installed"
}

UV_VERSION=0.13.9

uv_setup() {  # export DIFFTEST_UV: uv, installing from where pip installs (scripts/uv_env.py)
    # uv installs the same packages as pip several times faster (parallel downloads, unpacking and
    # byte-compiling). Any failure here leaves
    # DIFFTEST_UV empty and the installs use pip, as before; DIFFTEST_NO_UV=1 asks for pip.
    [[ ${DIFFTEST_NO_UV:-} == 1 ]] && return 0
    local dir=.cache/uv-venv py=${PYTHON:-python3}
    mkdir -p .cache/logs
    if [[ ! -x $dir/bin/uv || $("$dir/bin/uv" --version 2>/dev/null) != "uv $UV_VERSION"* ]]; then
        if ! { rm -rf "$dir" && "$py" -m venv "$dir" \
               && "$dir/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"; } \
               > .cache/logs/install-uv.log 2>&1; then
            echo "== uv $UV_VERSION could not be installed (.cache/logs/install-uv.log): the installs use pip"
            return 0
        fi
    fi
    eval "$("$py" scripts/uv_env.py)" || return 0
    export DIFFTEST_UV=$PWD/$dir/bin/uv
}

install_tester() {  # .venv: difftest with the extras named, e.g. install_tester '.[test]'
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
    # Locked as runners/*/make_env.sh lock theirs: each installs this repository editable, and two
    # such installs at once race on its difftest.egg-info.
    mkdir -p .cache
    local pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
    [[ -n ${DIFFTEST_UV:-} ]] && pip=("$DIFFTEST_UV" pip install -q --python .venv/bin/python)
    { flock 9; "${pip[@]}" -e "$1"; } 9> .cache/editable-install.lock
    echo "difftest $(.venv/bin/python -c 'import difftest; print(difftest.__version__)') in .venv"
}
