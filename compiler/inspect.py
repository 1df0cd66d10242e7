"""``fleet-compiler inspect``: verify a build's hashes and that every stage fuses stateful attention."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path


from fleet_common.manifest import load_manifest, verify_files
from fleet_common.runtime import check_kernels, stage_core

from .layers import ROUTER_SOFTMAX


@dataclass(frozen=True)
class StageReport:
    """Fusion facts read off one stage's *compiled* (runtime) model on ``device``."""

    index: int
    layers: tuple[int, int]
    sdpa_with_kv: int  # SDPA nodes reading the KV cache straight from state (MemoryInput)
    softmax: int  # unfused attention leaves Softmax nodes behind (a MoE router's own are not counted)
    compile_s: float

    @property
    def fused(self) -> bool:
        """True when every layer's attention is one SDPA fed by in-state KV and no Softmax is left."""
        return self.sdpa_with_kv == self.layers[1] - self.layers[0] and self.softmax == 0


def fusion_report(xml: Path, index: int, layers: tuple[int, int], device: str = "CPU") -> StageReport:
    """Compile ``xml`` on ``device`` and count fused stateful SDPA nodes: the plugin fuses a layer's attention
    with its KV state only when the KV reads have the chain compiler/export.py builds (``fused``)."""
    import time

    t0 = time.perf_counter()
    compiled = stage_core().compile_model(str(xml), device)
    elapsed = time.perf_counter() - t0
    ops = compiled.get_runtime_model().get_ops()

    def layer_type(op) -> str:  # noqa: ANN001
        return str(op.get_rt_info()["layerType"].astype(str))

    kinds = collections.Counter(layer_type(op) for op in ops)
    with_kv = sum(
        1
        for op in ops
        if layer_type(op) == "ScaledDotProductAttention"
        and any(layer_type(i.get_source_output().get_node()) == "MemoryInput" for i in op.inputs())
    )
    routers = sum(1 for op in ops if layer_type(op) == "Softmax" and ROUTER_SOFTMAX in op.get_friendly_name())
    return StageReport(index, layers, with_kv, kinds.get("Softmax", 0) - routers, elapsed)


def inspect(model_dir: Path, device: str = "CPU") -> tuple[list[str], list[StageReport]]:
    """Return (hash problems, per-stage fusion reports) for a build directory."""
    loaded = load_manifest(model_dir)
    problems = verify_files(loaded)
    for s in loaded.manifest.stages:  # one line saying what to install, not OpenVINO's unknown-op error
        check_kernels(s, f"stage {s.index} of {model_dir}")
    reports = [
        fusion_report(model_dir / s.xml, s.index, (s.start, s.end), device)
        for s in loaded.manifest.stages
        if (model_dir / s.xml).is_file()
    ]
    return problems, reports
