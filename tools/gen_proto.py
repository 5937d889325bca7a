"""Generate the Python code for proto/elasticmoe/v1/*.proto into elasticmoe/v1/.

Usage: python tools/gen_proto.py [--out DIR]   (DIR defaults to the repository root)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> None:
    from grpc_tools import protoc  # dev extra

    files = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "elasticmoe" / "v1").glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {files}")
    for pkg in (out / "elasticmoe", out / "elasticmoe" / "v1"):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated protobuf and gRPC code for the ElasticMoE wire contracts."""\n')


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args().out)
    sys.exit(0)
