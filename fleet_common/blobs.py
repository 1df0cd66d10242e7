"""Pre-compiled shard blobs: a stage's ``CompiledModel.export_model`` output, which a worker imports with
``Core.import_model`` instead of compiling the IR (OpenVINO docs: "Model Caching Overview" and the
``openvino.CompiledModel.export_model`` / ``openvino.Core.import_model`` API reference; the CPU plugin
lists ``EXPORT_IMPORT`` in its ``OPTIMIZATION_CAPABILITIES``).

A blob is only good for the IR it was compiled from, the device, the OpenVINO version, the compile
config (precision, threads, KV cache precision) and the hardware it was compiled on (the CPU plugin
picks its kernels by instruction set, the GPU plugin per GPU). ``BlobKey`` records all of these; a
worker imports a blob only when its key equals the one it would compile with here, and otherwise says
which of them differs (``BlobKey.mismatch``). A stage holding fleet's kernels' op also records their version
(``identity["fleet_kernels"]``): a blob runs the kernels of the install that imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from . import kernels
from .manifest import Manifest
from .runtime import compile_config, runs_compressed

# CPU instruction-set extensions whose presence changes which kernels the CPU plugin compiles in
# (/proc/cpuinfo names); a blob made where one of them differs is not imported.
ISA_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "amx_fp16")
IDENTITY_PROPERTIES = ("FULL_DEVICE_NAME", "DEVICE_ARCHITECTURE", "OPTIMIZATION_CAPABILITIES")


def _cpu_flags() -> str:
    """The ``ISA_FLAGS`` this CPU has (Linux ``/proc/cpuinfo``), space-separated; "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(flag for flag in ISA_FLAGS if flag in have)
    except OSError:
        pass
    return ""


def device_identity(core: ov.Core, device: str) -> dict[str, str]:
    """What a compiled model depends on besides its IR and config: the device's ``FULL_DEVICE_NAME``,
    ``DEVICE_ARCHITECTURE`` and ``OPTIMIZATION_CAPABILITIES`` (read-only device properties, OpenVINO docs
    "Query Device Properties"), plus, for a CPU, its instruction-set flags and machine type.

    Raises ``RuntimeError`` when OpenVINO has no such device here."""
    identity = {}
    supported = core.get_property(device, "SUPPORTED_PROPERTIES")
    for name in IDENTITY_PROPERTIES:
        if name in supported:
            value = core.get_property(device, name)
            identity[name] = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if device.split(".")[0] == "CPU":
        identity["isa"] = _cpu_flags()
        identity["machine"] = platform.machine()
    return identity


def ir_digest(manifest: Manifest, stage: int) -> str:
    """sha256 over the stage's IR (the manifest's hashes of its .xml and .bin): which IR a blob is of."""
    entry = manifest.stages[stage]
    both = f"{manifest.files.get(entry.xml, entry.xml)} {manifest.files.get(entry.bin, entry.bin)}"
    return hashlib.sha256(both.encode()).hexdigest()


def shard_config(threads: int, inference_precision: str, kv_cache_precision: str,
                 compressed_cpu: bool = False) -> dict[str, object]:
    """The properties a worker compiles its shard with (``fleet_common.runtime.compile_config``) with the
    KV cache precision spelled out: the build's (written into the IR), f32 under ``inference_precision``
    f32. ``import_model`` is given these too (it does not read the IR's runtime options)."""
    config = compile_config(threads, inference_precision, compressed_cpu)
    config.setdefault("KV_CACHE_PRECISION", kv_cache_precision)
    return config


@dataclass(frozen=True)
class BlobKey:
    """Everything a compiled blob is only valid for; recorded in the manifest next to the blob."""

    ir: str  # ir_digest of the stage
    device: str  # "CPU", "GPU", "GPU.1", ...
    openvino_version: str  # ov.get_version() of the compiler
    identity: dict[str, str] = field(default_factory=dict)  # device_identity where it was compiled
    config: dict[str, str] = field(default_factory=dict)  # shard_config, values as strings

    @classmethod
    def here(cls, manifest: Manifest, stage: int, device: str, threads: int, inference_precision: str,
             core: ov.Core | None = None) -> BlobKey:
        """The key of a blob compiled here, now, for ``stage`` with this worker config."""
        config = shard_config(threads, inference_precision, manifest.kv_cache_precision,
                              runs_compressed(device, manifest.stages[stage]))
        identity = device_identity(core or ov.Core(), device)
        if manifest.stages[stage].kernels:  # the blob runs fleet's kernels of this install: their version too
            identity["fleet_kernels"] = kernels.KERNELS_VERSION if kernels.available() else "missing"
        return cls(ir_digest(manifest, stage), device, ov.get_version(), identity,
                   {k: str(v) for k, v in config.items()})

    @classmethod
    def from_dict(cls, raw: dict) -> BlobKey:
        """Read a manifest's ``key`` (a missing field reads as empty, so it never matches)."""
        return cls(str(raw.get("ir", "")), str(raw.get("device", "")), str(raw.get("openvino_version", "")),
                   dict(raw.get("identity", {})), dict(raw.get("config", {})))

    def to_dict(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """Short hash of the whole key (names the blob file)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def mismatch(self, wanted: BlobKey) -> str | None:
        """Why a blob with this key must not be imported where ``wanted`` is the key of what would be
        compiled (a phrase such as "is for OpenVINO X, this is Y"), or None when the keys are equal."""
        if self.ir != wanted.ir:
            return "was compiled from another IR of this stage"
        if self.device != wanted.device:
            return f"is for device {self.device}, this worker runs on {wanted.device}"
        if self.openvino_version != wanted.openvino_version:
            return f"is for OpenVINO {self.openvino_version}, this is {wanted.openvino_version}"
        if self.identity != wanted.identity:
            return f"was compiled on another {self.device}: {_differences(self.identity, wanted.identity)}"
        if self.config != wanted.config:
            return f"was compiled with other settings: {_differences(self.config, wanted.config)}"
        return None


def _differences(blob: dict[str, str], here: dict[str, str]) -> str:
    """"K 'a' in the blob, 'b' here; ..." for each key whose value differs (unset where missing)."""
    def show(d: dict[str, str], k: str) -> str:
        return repr(d[k]) if k in d else "unset"

    return "; ".join(f"{k} {show(blob, k)} in the blob, {show(here, k)} here"
                     for k in sorted(set(blob) | set(here)) if blob.get(k) != here.get(k))


def blob_name(stage_xml: str, key: BlobKey) -> str:
    """Where a stage's blob goes, relative to the build: next to its IR, named by device and key."""
    device = key.device.lower().replace(".", "")
    return str(Path(stage_xml).with_suffix("")) + f".{device}-{key.digest()}.blob"


def export_blob(compiled: ov.CompiledModel, path: Path) -> str:
    """Write ``compiled.export_model()`` to ``path`` (atomically: a reader never sees half a blob and a
    worker that has the old one mapped keeps it); return its sha256. Raises ``OSError`` when unwritable."""
    data = compiled.export_model()  # bytes, or an io.BytesIO in recent releases (the blob is held in memory once)
    data = data.getbuffer() if hasattr(data, "getbuffer") else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return hashlib.sha256(data).hexdigest()


@dataclass
class ImportedBlob:
    """A compiled model imported from a blob, and the memory map it reads its weights from: the map
    must live as long as the model (the import does not copy the weights, nor keep the map alive)."""

    compiled: ov.CompiledModel
    mapping: np.memmap


def import_blob(core: ov.Core, path: Path, device: str, config: dict[str, object]) -> ImportedBlob:
    """``core.import_model`` of the blob at ``path``, memory-mapped (copy-on-write, so the file itself is
    never written) rather than read: importing the demo's stage 0 takes 0.09 s this way, 0.8 s from bytes.

    Raises ``RuntimeError`` when OpenVINO refuses the blob, ``OSError``/``ValueError`` when the file
    cannot be mapped (missing, empty)."""
    mapping = np.memmap(path, dtype=np.uint8, mode="c")
    compiled = core.import_model(ov.Tensor(mapping, shared_memory=True), device, config)
    return ImportedBlob(compiled, mapping)
