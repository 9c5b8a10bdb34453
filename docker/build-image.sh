#!/usr/bin/env bash
# Build the CPU image with buildah: no Docker engine and no registry needed.
#   docker/build-image.sh [TAG]     (default localhost/reflow:cpu)
# BASE_IMAGE       the image to build on; default localhost/reflow-base:bookworm,
#                  made from Debian's packages (docker/base-image.sh) when missing.
# CA_BUNDLE        the CA certificates pip trusts in the build (a build secret; default
#                  the host's, which knows any TLS-intercepting proxy it goes through).
# TORCH_WHEEL_DIR  a directory holding the torch 2.13.0 CPU wheel (default pip's
#                  find-links, $PIP_FIND_LINKS); copied into docker/wheels/, after
#                  which the PyTorch index is not asked (TORCH_INDEX= overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs} BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
tag=${1:-localhost/reflow:cpu}
base=${BASE_IMAGE:-localhost/reflow-base:bookworm}
if [ "$base" = localhost/reflow-base:bookworm ] && ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  docker/base-image.sh "$base"
fi
index=https://download.pytorch.org/whl/cpu
wheel_dir=${TORCH_WHEEL_DIR:-${PIP_FIND_LINKS:-}}
if [ -n "$wheel_dir" ] && ls "$wheel_dir"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  cp -u "$wheel_dir"/torch-2.13.0+cpu-*.whl docker/wheels/
  index=
fi
start=$(date +%s)
# No intermediate layers: with vfs storage each is a full copy of the tree.
ca=${CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
buildah bud --layers=false -f docker/Dockerfile.cpu --build-arg BASE_IMAGE="$base" \
  --secret id=pip_ca,src="$ca" \
  --build-arg TORCH_INDEX="${TORCH_INDEX-$index}" -t "$tag" .
# The build stage's image is of no further use.
buildah rmi --prune >/dev/null 2>&1 || true
echo "built $tag in $(( $(date +%s) - start )) s: $(buildah images --format '{{.Size}}' "$tag")"
