#!/usr/bin/env bash
# The README's two commands on a new machine, shown: a Debian 12 root made from Debian's packages
# (debootstrap, then every package of the base list a new machine has), a fresh clone of this
# repository inside it, and both commands run there with nothing installed by hand. Root only.
#
#   scripts/clean-root.sh build ROOT   make the root (debootstrap + the base list; about 10 min)
#   scripts/clean-root.sh run ROOT     a fresh copy of the root (ROOT.run: nothing an earlier run
#                                      installed), HEAD cloned into it, scripts/demo.sh then
#                                      CI=true .ci/run there, each timed; logs in ROOT.run/work/*.log
#
# The base list is ../shared/machine/debian-base-packages.txt (tests/data/ holds a copy). What a new
# machine has beside its Debian packages is bound in read-only, as that machine has it: the
# interpreter the project runs on (python3 on PATH here, not Debian's), the torch wheel and package
# indexes on disk, and pip's configuration. Nothing else of this machine is visible inside.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cmd=${1:?usage: clean-root.sh build|run ROOT}
root=$(realpath -m "${2:?usage: clean-root.sh build|run ROOT}")
[ "$(id -u)" = 0 ] || { echo "clean-root.sh: debootstrap and chroot need root" >&2; exit 2; }
base=../shared/machine/debian-base-packages.txt
[ -f "$base" ] || base=tests/data/debian-base-packages.txt

# What the image carries outside Debian's packages (the python kind's machine doc): bound read-only.
py_prefix=$(python3 -c 'import sys; print(sys.base_prefix)')  # the image's interpreter, not a shim
# The image's certificate authorities too: its registries are reached through them.
image_paths=("$py_prefix" /opt/wheels /opt/pypi /opt/pypi-more /etc/pip.conf /etc/xdg/pip
             "$HOME/.config/pip" "$HOME/.pip" /etc/ssl/certs/ca-certificates.crt /usr/local/share/ca-certificates)

mounts() {  # bind the kernel's file systems into the root, and with `image` the image's own paths
    mount --bind /proc "$root/proc"; mount --bind /sys "$root/sys"
    mount --rbind /dev "$root/dev"; mount --make-rslave "$root/dev"
    [ "${1:-}" = image ] || return 0  # building: Debian's packages write their own (ca-certificates)
    for p in "${image_paths[@]}"; do
        [ -e "$p" ] || continue
        if [ -d "$p" ]; then mkdir -p "$root$p"; else mkdir -p "$root$(dirname "$p")"; touch "$root$p"; fi
        mount --bind "$p" "$root$p"; mount -o remount,bind,ro "$root$p"
    done
    cp /etc/resolv.conf "$root/etc/resolv.conf"
}
unmount() {
    for p in "${image_paths[@]}" /dev /sys /proc; do
        mountpoint -q "$root$p" && umount -R -l "$root$p" || true
    done
}

in_root() {  # COMMAND: run it inside the root as a new machine's root user would
    chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH="$py_prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        PIP_FIND_LINKS="${PIP_FIND_LINKS:-}" PIP_CERT="${PIP_CERT:-}" SSL_CERT_FILE="${SSL_CERT_FILE:-}" \
        REQUESTS_CA_BUNDLE="${REQUESTS_CA_BUNDLE:-}" CURL_CA_BUNDLE="${CURL_CA_BUNDLE:-}" \
        GIT_SSL_CAINFO="${GIT_SSL_CAINFO:-}" CI=true bash -c "$1"
}

case $cmd in
build)
    command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
    # the mirror this machine's apt uses (no host is named here)
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
             || awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
    start=$SECONDS
    [ -x "$root/usr/bin/apt-get" ] || debootstrap --variant=minbase bookworm "$root" "$mirror"
    # the machine's own apt sources (its updates and security suites), in place of debootstrap's
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/" 2>/dev/null \
        && rm -f "$root/etc/apt/sources.list"
    trap unmount EXIT; mounts
    grep -v '^#' "$base" | grep . > "$root/base-packages.txt"
    in_root 'apt-get update -qq
        avail=$(xargs apt-cache policy < /base-packages.txt | awk "/^[^ ]/ {p=\$1} /Candidate: [^(]/ {sub(\":\$\",\"\",p); print p}")
        echo "$avail" | comm -13 - <(sort /base-packages.txt) | sed "s/^/not in Debian: /"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $avail > /base-install.log 2>&1 \
            || { tail -20 /base-install.log; exit 1; }
        dpkg-query -W -f "\${Package}\n" | wc -l | sed "s/\$/ Debian packages installed/"'
    echo "clean root ready at $root in $((SECONDS - start)) s"
    ;;
run)
    [ -x "$root/usr/bin/apt-get" ] || { echo "clean-root.sh: no root at $root: run 'build' first" >&2; exit 2; }
    rm -rf "$root.run"; cp -a "$root" "$root.run"; root=$root.run  # the built root stays as built
    trap unmount EXIT; mounts image
    rm -rf "$root/work"; mkdir -p "$root/work"
    git clone -q "$repo" "$root/work/main"
    [ -d ../shared ] && cp -r ../shared "$root/work/shared" && chmod -R a-w "$root/work/shared"
    echo "commit $(git -C "$root/work/main" rev-parse --short HEAD); Debian packages in the root: $(chroot "$root" dpkg-query -W | wc -l)"
    rc=0
    for step in "bash scripts/demo.sh" "bash .ci/run"; do
        name=${step##*/}
        t=$SECONDS
        in_root "cd /work/main && $step" > "$root/work/$name.log" 2>&1 || rc=$?
        echo "$step: exit ${rc}, $((SECONDS - t)) s ($(grep -E '[0-9]+ (passed|failed)' "$root/work/$name.log" | tail -n 1))"
        [ "$rc" = 0 ] || { tail -n 40 "$root/work/$name.log"; break; }
    done
    exit "$rc"
    ;;
*) echo "usage: clean-root.sh build|run ROOT" >&2; exit 2 ;;
esac
