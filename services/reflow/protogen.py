"""Generate the gRPC Python code from protos/ (one documented step).

    python -m reflow.protogen           # write services/reflow/v1/*_pb2*.py
    python -m reflow.protogen --check   # exit 1 when the checked-in code is stale

The generated modules are committed so that an installed package needs no
protoc; a test runs `--check` so they never drift from the .proto files.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
OUT_ROOT = REPO / "services"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("reflow/v1/*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out_dir = out_root / "reflow" / "v1"
    (out_dir / "__init__.py").write_text('"""Generated gRPC code; see reflow.protogen."""\n')
    return sorted(out_dir.iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT_ROOT):
            print(path.relative_to(REPO))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if p.is_file()
            and not (
                (OUT_ROOT / "reflow" / "v1" / p.name).exists()
                and filecmp.cmp(p, OUT_ROOT / "reflow" / "v1" / p.name, shallow=False)
            )
        ]
    if stale:
        print("stale generated code: " + ", ".join(stale) + "; run `python -m reflow.protogen`")
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
