"""What a CPU build of a GGUF must hold: each matrix fleet's kernels multiply (``GgufMatMul``) reads a u8 Constant
whose bytes in the stage's ``.bin`` are the GGUF tensor's bytes as they lie in the file (a fused tensor's row
range for phi3's q/k/v and gate/up; llama's Q/K rows in the file's permuted order), compared by sha256."""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from compiler.gguf_read import read_gguf_file

EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def kernel_constants(xml: Path, op: str = "GgufMatMul") -> dict[str, tuple[str, str, int, int]]:
    """The Constants the ``op`` nodes (``GgufMatMul``, ``GgufMoeMatMul``) of IR ``xml`` multiply by: name -> (block
    type, precision, byte offset in the ``.bin``, size), read from the IR's own XML."""
    root = ET.parse(xml).getroot()
    layers = {layer.get("id"): layer for layer in root.iter("layer")}
    into = {(e.get("to-layer"), e.get("to-port")): e.get("from-layer") for e in root.iter("edge")}
    found = {}
    for layer in layers.values():
        if layer.get("type") != op:
            continue
        ports = [p.get("id") for p in layer.find("input").iter("port")]
        attrs = layer.find("data")
        types = attrs.get("block_type").split(",")  # a GgufMatMul of several tensors: one type each
        assert len(types) == len(ports) - 1 or op != "GgufMatMul", attrs.attrib
        for port, block_type in zip(ports[1:], types):
            const = layers[into[(layer.get("id"), port)]]
            data = const.find("data")
            assert const.get("type") == "Const" and data.get("element_type") == "u8", const.attrib
            found[const.get("name")] = (block_type, attrs.get("precision"), int(data.get("offset")),
                                        int(data.get("size")))
    return found


def assert_constants_are_gguf_bytes(build: Path, gguf_path: Path, work: Path) -> int:
    """Every ``GgufMatMul`` constant of every stage of ``build`` holds, byte for byte (sha256), the bytes of the
    GGUF tensor (or fused tensor's rows) of its name as the file holds them, with the file's type; each stage
    whose manifest entry names fleet's kernels has such nodes and no other does. Returns how many were checked."""
    from compiler.source import open_source
    from fleet_common.kernels import KERNELS_VERSION

    weights = open_source(gguf_path, work).weights  # its tensors: memory-mapped views of the file's bytes
    manifest = json.loads((build / "manifest.json").read_text())
    checked = 0
    for stage in manifest["stages"]:
        found = kernel_constants(build / stage["xml"])
        assert bool(found) == (stage.get("kernels") == KERNELS_VERSION), (stage, len(found))
        blob = np.memmap(build / stage["bin"], dtype=np.uint8, mode="r")
        for name, (block_type, precision, offset, size) in found.items():
            t = weights.tensors[name]
            want = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8)
            assert (block_type, precision) == (t.qtype, "int8"), (name, block_type, precision, t.qtype)
            got = hashlib.sha256(blob[offset:offset + size]).hexdigest()
            assert size == want.nbytes and got == hashlib.sha256(want).hexdigest(), name
            checked += 1
    return checked


def assert_experts_are_gguf_bytes(build: Path, gguf_path: Path) -> int:
    """Every ``GgufMoeMatMul`` constant of every stage of ``build`` (``model.layers.N.mlp.experts.gate_proj.weight``:
    one expert matrix of layer N, all experts) holds, byte for byte (sha256), the GGUF's stacked expert tensor
    ``blk.N.ffn_gate_exps.weight`` (up, down likewise) as the file holds it, with the file's type. Returns how many
    were checked."""
    import gguf

    tensors = {t.name: t for t in read_gguf_file(str(gguf_path)).tensors}
    manifest = json.loads((build / "manifest.json").read_text())
    checked = 0
    for stage in manifest["stages"]:
        blob = np.memmap(build / stage["bin"], dtype=np.uint8, mode="r")
        for name, (block_type, precision, offset, size) in kernel_constants(build / stage["xml"],
                                                                            "GgufMoeMatMul").items():
            layer, part = name.split(".")[2], EXPERT_PARTS[name.split(".")[-2]]
            t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            want = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8)
            assert (block_type, precision) == (gguf.GGMLQuantizationType(t.tensor_type).name, "int8"), name
            got = hashlib.sha256(blob[offset:offset + size]).hexdigest()
            assert size == want.nbytes and got == hashlib.sha256(want).hexdigest(), name
            checked += 1
    return checked
