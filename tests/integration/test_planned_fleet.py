"""The planner on the real demo model (issue 5, items 3-4): ``fleet-worker --profile --json`` gives a node
record ``fleet-compiler plan`` uses; a plan for unequal nodes, built with ``build --plan`` (one stage
recorded for a GPU) and served by a real 2-worker fleet, answers token for token as the default split.

The planned build is cached under models/test like the other test builds (keyed by the compiler's code
and the plan), so ``build --plan`` runs when either changes. Isolation: other tests on this machine run
fleets at the same time, so workers start with ``--no-announce`` and the coordinator with
``--no-discover --peer``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from compiler.cli import main as compiler_main
from fleet_common.kernels import KERNELS_VERSION
from fleet_common.manifest import KERNELS_FORMAT, load_manifest
from tests.conftest import BIN, MODELS, ROOT, Fleet, chat, compiler_key
from tests.integration.test_compiler import run_cli

pytestmark = pytest.mark.integration

PROMPTS = ["What is the capital of France?", "List five fruits and their colors."]
TOKENS = 32


def test_profile_prints_a_node_record_the_planner_uses(build_2, tmp_path, capsys):
    out = subprocess.run([str(BIN / "fleet-worker"), "--profile", "--model", str(build_2), "--threads", "1",
                          "--name", "pc1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert (record["name"], record["device"], record["stage"], record["layers"], record["lm_head"]) == \
        ("pc1", "CPU", 0, 19, False)
    assert record["memory_bytes"] > 1 << 28 and 0 < record["ms_per_layer"] < 100
    assert record["ms_per_layer"] == pytest.approx(record["ms_per_token"] / 19, rel=1e-3)
    assert f"--node pc1:{record['memory_bytes'] >> 20}MiB:" in out.stderr  # the human line

    slower = {**record, "name": "pc2", "ms_per_layer": 2 * record["ms_per_layer"]}
    nodes = tmp_path / "nodes.json"  # JSON Lines: what `fleet-worker --profile --json >> nodes.json` adds up to
    nodes.write_text(json.dumps(slower) + "\n" + json.dumps(record) + "\n")
    assert compiler_main(["plan", str(build_2), "--nodes", str(nodes), "--max-context", "512", "--max-sessions", "1",
                          "-o", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [s["node"] for s in plan["stages"]] == ["pc2", "pc1"]
    assert plan["layers"] == "0:12,12:30"  # the twice-as-fast pc1: 18 layers + the head (8) vs 2 x 12 on pc2
    assert plan["predicted_ms_per_token"] == pytest.approx(26 * record["ms_per_layer"], rel=1e-3)
    assert "predicted" in capsys.readouterr().out


@pytest.fixture(scope="module")
def planned(demo_hf, tmp_path_factory) -> tuple[Path, str]:
    """(build, layers): a plan for a slow node with a GPU and a node twice as fast, built with build --plan."""
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    assert compiler_main(["plan", str(demo_hf), "--node", "slow:4GiB:1:GPU", "--node", "fast:4GiB:2",
                          "--max-context", "1024", "--max-sessions", "2", "-o", str(plan)]) == 0
    layers = json.loads(plan.read_text())["layers"]
    key = hashlib.sha256((compiler_key() + layers + (ROOT / "compiler" / "planner.py").read_text()).encode())
    build = MODELS / f"smollm2-planned-{key.hexdigest()[:10]}"
    if not (build / "manifest.json").is_file():
        out = run_cli("build", str(demo_hf), "--plan", str(plan), "-o", str(build))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "stage 0: layers [0, 12), fp16, GPU" in out.stdout
    return build, layers


def answers(build: Path, log_dir: Path) -> tuple[list[str], list[str]]:
    """Greedy answers to PROMPTS from a 2-worker fleet of ``build`` (f32) and the workers' logs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(build, log_dir, peers=True)
    try:
        texts = []
        for prompt in PROMPTS:
            r = chat(fleet.url, prompt, max_tokens=TOKENS, ignore_eos=True)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == TOKENS
            texts.append(r.json()["choices"][0]["message"]["content"])
        return texts, [proc.text() for proc, _ in fleet.workers]
    finally:
        fleet.stop()


def test_planned_build_answers_as_the_default_split(planned, build_2, tmp_path):
    build, layers = planned
    manifest = load_manifest(build).manifest
    assert layers == "0:12,12:30" and [(s.start, s.end) for s in manifest.stages] == [(0, 12), (12, 30)]
    assert [s.device for s in manifest.stages] == ["GPU", "CPU"] and manifest.format == KERNELS_FORMAT
    # the GPU stage in OpenVINO's forms, the CPU stage on fleet's kernels (a GPU plugin runs no CPU extension op)
    assert [s.kernels for s in manifest.stages] == [None, KERNELS_VERSION]
    assert [(s.start, s.end) for s in load_manifest(build_2).manifest.stages] == [(0, 19), (19, 30)]
    shown = run_cli("inspect", str(build))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[2] for row in rows] == ["GPU", "CPU"] and all(row[-1] == "ok" for row in rows)

    mine, logs = answers(build, tmp_path / "planned")
    assert "stage 0 was planned for GPU (the manifest's device); this worker runs it on CPU" in logs[0]
    assert "was planned for" not in logs[1]
    theirs, _ = answers(build_2, tmp_path / "default")
    assert mine == theirs
