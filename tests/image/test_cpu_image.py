"""The CPU image, built by `make image` (buildah, docker/build-image.sh), run as a
user would run it: the CLI answers, and the quickstart job trains inside the
container as the non-root user 10001 with the root filesystem read-only (only
/tmp and the run directory writable, as the chart mounts them).

Not in `make test` (the image takes minutes to build): `make test-image`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess  # nosec B404 # buildah, mount and chroot, with fixed arguments
from pathlib import Path

import pytest

pytestmark = [pytest.mark.image, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("REFLOW_IMAGE", "localhost/reflow:cpu")
ENV = {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}
UID = 10001


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=ENV, text=True, capture_output=True, **kwargs)  # nosec


@pytest.fixture(scope="module")
def container():
    if shutil.which("buildah") is None:
        pytest.fail("buildah is not installed: apt-get install -y buildah, then make image")
    if _run("buildah", "inspect", "--type", "image", IMAGE).returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it first with `make image`")
    name = _run("buildah", "from", IMAGE).stdout.strip()
    rootfs = Path(_run("buildah", "mount", name).stdout.strip())
    yield name, rootfs
    _run("buildah", "umount", name)
    _run("buildah", "rm", name)


def test_the_cli_answers_as_the_non_root_user(container):
    name, _ = container
    result = _run("buildah", "run", "--user", f"{UID}:{UID}", name, "--",
                  "tini", "--", "reflow", "--help")
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "run" in result.stdout
    whoami = _run("buildah", "run", "--user", f"{UID}:{UID}", name, "--", "id", "-u")
    assert whoami.stdout.strip() == str(UID)


def test_the_quickstart_learns_in_the_container_with_a_read_only_root(container, tmp_path):
    """The container's root is bind-mounted read-only in a mount namespace of its
    own (buildah run has no --read-only), with a tmpfs /tmp and the run directory
    from the host, then the job runs there through chroot as uid 10001."""
    _, rootfs = container
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, UID, UID)
    script = f"""
set -e
root=$(mktemp -d)
mount --bind {rootfs} "$root"
mount -o remount,bind,ro "$root"
mount -t proc proc "$root/proc"
mount --bind /etc/hosts "$root/etc/hosts"
mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs -o mode=1777,size=8g tmpfs "$root/tmp"
mount --bind {runs} "$root/tmp/runs" 2>/dev/null || {{ mkdir -p "$root/tmp/runs"; mount --bind {runs} "$root/tmp/runs"; }}
mkdir -p "$root/tmp/examples" && mount --bind -o ro {REPO / 'examples'} "$root/tmp/examples"
mount -o remount,bind,ro "$root/tmp/examples"
if chroot "$root" /bin/touch /opt/reflow/written 2>/dev/null; then echo "root is writable"; exit 3; fi
cd /
exec chroot --userspec={UID}:{UID} "$root" /usr/bin/env -i PATH=/opt/reflow/bin:/usr/bin:/bin \\
  HOME=/tmp XDG_CACHE_HOME=/tmp/.cache VLLM_CACHE_ROOT=/tmp/vllm HF_HUB_OFFLINE=1 \\
  PYTHONUNBUFFERED=1 REFLOW_MODELS_DIR=/tmp/models \\
  /bin/sh -c 'cd /tmp && exec tini -- reflow run /tmp/examples/quickstart.yaml --out /tmp/runs/quickstart'
"""
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork",  # nosec
                             "sh", "-c", script], text=True, capture_output=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((runs / "quickstart" / "summary.json").read_text())
    print(json.dumps(summary, indent=1))
    records = [json.loads(line) for line in
               (runs / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward_mean"] for r in records[:10]) / 10
    last = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert len(records) == 150
    # The quickstart's reward rises about 0.5 from its first ten steps to its last.
    assert last - first > 0.25, (first, last)
