#!/usr/bin/env bash
# A Debian bookworm base image with Debian's Python 3.11, made from Debian's own
# packages (debootstrap), for where no image registry is reachable.
#   docker/base-image.sh [TAG]      (default localhost/reflow-base:bookworm)
# DEBIAN_MIRROR: the archive to bootstrap from (default deb.debian.org).
set -euo pipefail
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
tag=${1:-localhost/reflow-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$mirror"
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
# Python from Debian's packages, installed as in any Debian system.
mount -t proc proc "$root/proc"
trap 'umount "$root/proc" 2>/dev/null || true; rm -rf "$root"' EXIT
chroot "$root" apt-get update -qq
DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get install -y -qq --no-install-recommends \
  python3.11 python3.11-venv ca-certificates
umount "$root/proc"
chroot "$root" apt-get clean
# The runtime mounts /dev and /proc; package lists come back with apt-get update.
rm -rf "$root"/dev/* "$root"/proc/* "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
ln -sf python3.11 "$root/usr/bin/python3"
# Container runtimes mount their own over these; a bare chroot needs them to exist.
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
touch "$root/etc/resolv.conf"
ctr=$(buildah from scratch)
buildah copy --quiet "$ctr" "$root" /
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
buildah commit --quiet --rm "$ctr" "$tag"
echo "base image $tag"
