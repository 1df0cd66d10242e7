"""Regenerate the Python stubs for proto/fleet.proto into fleet_common/ (or --out DIR).

Usage: python proto/generate.py [--out DIR]. Needs grpcio-tools (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out: Path) -> list[Path]:
    """Write ``fleet_pb2.py``, ``fleet_pb2.pyi`` and ``fleet_pb2_grpc.py`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    proto_dir = ROOT / "proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_dir}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto_dir / "fleet.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_file = out / "fleet_pb2_grpc.py"
    # protoc emits an absolute import; the stubs live inside the fleet_common package.
    grpc_file.write_text(re.sub(r"^import fleet_pb2 as", "from . import fleet_pb2 as", grpc_file.read_text(), flags=re.M))
    return [out / "fleet_pb2.py", out / "fleet_pb2.pyi", grpc_file]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "fleet_common")
    for path in generate(parser.parse_args().out):
        print(path)
