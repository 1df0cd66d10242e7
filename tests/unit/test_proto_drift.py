"""The committed stubs must be exactly what proto/generate.py makes from proto/fleet.proto."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_schema(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    for fresh in generate.generate(tmp_path):
        committed = ROOT / "fleet_common" / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `python proto/generate.py` and commit the result")
