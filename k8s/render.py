"""Render the Helm chart into plain manifests for clusters without Helm.

    python k8s/render.py            # rewrite k8s/reflow.yaml
    python k8s/render.py --check    # exit 1 when k8s/reflow.yaml is stale

Rendered with k8s/values.yaml: release "reflow" in namespace "reflow", and
existing Secrets for the API token, the Redis passwords, the gRPC secrets and each role's
TLS certificate, so no secret value is ever written into the manifests (k8s/README.md
creates them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "reflow"
VALUES = ROOT / "k8s" / "values.yaml"
OUT = ROOT / "k8s" / "reflow.yaml"
RELEASE, NAMESPACE = "reflow", "reflow"

HEADER = """\
# ReFlow plain Kubernetes manifests, rendered from charts/reflow with
# k8s/values.yaml by `python k8s/render.py`. Do not edit by hand.
# Apply: see k8s/README.md (create the namespace and the Secrets first).
"""


def render(values_path: Path = VALUES) -> str:
    import helm_python as helm

    values = yaml.safe_load(values_path.read_text()) or {}
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path in sorted(files):
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(files[path]):
            if doc:
                docs.append(doc)
    # Namespaced objects carry the namespace, so `kubectl apply -f` needs no -n.
    for doc in docs:
        doc.setdefault("metadata", {})["namespace"] = NAMESPACE
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)
    return HEADER + "---\n" + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run `python k8s/render.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
