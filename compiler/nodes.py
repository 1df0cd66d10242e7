"""The fleet's PCs as the planner sees them: ``--node NAME:MEM[:SPEED[:DEVICE]]`` and ``--nodes FILE``.

A node file is JSON (one record, a list of records, ``{"nodes": [...]}``, or JSON Lines: what
``fleet-worker --profile --json >> nodes.json`` on each PC adds up to) or TOML (``[[nodes]]`` tables,
Python 3.11+). A record names ``name``, its memory (``memory_bytes``, or ``memory`` such as
``"8GiB"``), ``device`` (default CPU) and its speed: ``ms_per_layer`` measured by ``fleet-worker
--profile``, or a relative ``speed`` (default 1; 2 = twice as fast). A profile taken on a stage that
holds the LM head (a 1-stage build) also gives ``ms_per_token``, ``layers`` and ``lm_head``, and the
head's share is taken out of its time here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

UNITS = {"": None, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
         "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
DEVICE = re.compile(r"^(CPU|GPU|NPU)(\.\d+)?$")


@dataclass(frozen=True)
class Node:
    """One PC (and device) of the fleet: the memory its worker may use and how fast it runs a layer."""

    name: str
    memory_bytes: int  # what the worker may use: weights, KV cache and runtime (the planner's budget)
    speed: float = 1.0  # relative speed (2: runs a layer in half the time); from ms_per_layer when given
    device: str = "CPU"  # OpenVINO device the stage is compiled for: CPU, GPU, NPU (GPU.1 ...)
    ms_per_layer: float | None = None  # measured: one decoder layer's time per decoded token (fleet-worker --profile)

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ":,\n"):
            raise ValueError(f"node name {self.name!r} must be non-empty without ':', ',' or newlines")
        if self.memory_bytes <= 0:
            raise ValueError(f"node {self.name!r}: memory must be positive")
        if not self.speed > 0 or (self.ms_per_layer is not None and not self.ms_per_layer > 0):
            raise ValueError(f"node {self.name!r}: speed and ms per layer must be positive")
        if not DEVICE.match(self.device):
            raise ValueError(f"node {self.name!r}: device {self.device!r} is not CPU, GPU or NPU (optionally .N)")


def parse_size(text: str) -> int:
    """``"8GiB"``, ``"8G"`` (binary), ``"8GB"`` (decimal), ``"512MiB"``, ``"1.5T"`` -> bytes.

    Raises ``ValueError`` for a number without a unit (MiB or GiB? say which) or an unknown unit."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = UNITS.get(m.group(2).lower(), False) if m else False
    if unit is None:
        raise ValueError(f"memory {text!r} needs a unit, e.g. 8GiB or 512MiB")
    if not unit:
        raise ValueError(f"memory {text!r}: expected a size such as 8GiB, 6G or 512MiB")
    return int(float(m.group(1)) * unit)


def parse_node(spec: str) -> Node:
    """``NAME:MEM[:SPEED[:DEVICE]]`` -> Node. SPEED is relative (``2``) or measured per layer (``0.31ms``);
    raises ``ValueError`` naming the spec."""
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"--node {spec!r}: expected NAME:MEM[:SPEED[:DEVICE]], e.g. pc1:8GiB:2:GPU")
    try:
        speed, ms = 1.0, None
        if len(parts) > 2 and parts[2]:
            text = parts[2].strip().lower()
            if text.endswith("ms"):
                ms = float(text[:-2])
            else:
                speed = float(text)
        return Node(parts[0], parse_size(parts[1]), speed, parts[3].upper() if len(parts) > 3 else "CPU", ms)
    except ValueError as exc:
        raise ValueError(f"--node {spec!r}: {exc}") from None


def node_from_record(record: dict, head_layers: float) -> Node:
    """A node from one JSON/TOML record (see the module doc). ``head_layers``: the LM head's cost in
    layers' worth (``compiler.planner.ModelDims.head_layers``), taken out of a profile that includes it.
    Raises ``ValueError`` naming the record's problem."""
    name = record.get("name")
    try:
        if "memory_bytes" in record:
            memory = int(record["memory_bytes"])
        elif "memory" in record:
            memory = parse_size(str(record["memory"]))
        else:
            raise ValueError("no memory_bytes or memory")
        ms = record.get("ms_per_layer")
        if record.get("lm_head") and record.get("ms_per_token") and record.get("layers"):
            ms = float(record["ms_per_token"]) / (int(record["layers"]) + head_layers)
        return Node(str(name or ""), memory, float(record.get("speed", 1.0)), str(record.get("device", "CPU")).upper(),
                    None if ms is None else float(ms))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"node record {name!r}: {exc}") from None


def read_nodes(path: Path, head_layers: float) -> list[Node]:
    """Nodes of a JSON, JSON Lines or TOML file (see the module doc), in file order.

    Raises ``ValueError`` for a file that is none of these or a bad record, ``FileNotFoundError``."""
    text = Path(path).read_text()
    if Path(path).suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{path}: TOML node files need Python 3.11+; use JSON") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is neither JSON nor JSON Lines: {exc}") from None
    if isinstance(data, dict):
        data = data.get("nodes", [data])
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data) or not data:
        raise ValueError(f"{path}: expected node records (a list, {{\"nodes\": [...]}} or one per line)")
    return [node_from_record(r, head_layers) for r in data]
