"""Lazy, memory-mapped reads of a model's weights from safetensors (one file or an HF sharded index).

Nothing is read when a source opens but the files' headers: each header is checked by the
``safetensors`` library (the format's own validation: JSON, dtypes, offsets that tile the data) and
against the file's size, so a truncated or corrupt file, or a shard missing from the index, is one
clear ``WeightsError`` naming the file before any heavy work. ``tensor(name)`` then maps just that
tensor's bytes (``numpy.memmap``) and returns it as float16; the mapping goes when the array does, so
a build holds at most the tensor being written (compiler/export.py writes each weight as the
serializer asks for it).

bf16 has no numpy dtype: its 16 bits are the high half of an f32, widened by a shift, then rounded
to f16 (exact for every bf16 value within f16's normal range; a weight beyond f16's range is
refused rather than turned into inf). Format: https://huggingface.co/docs/safetensors (header: 8-byte
little-endian length, JSON of ``{name: {dtype, shape, data_offsets}}``, then the data).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
F16_MAX = 65504.0
CHUNK_BYTES = 32 << 20  # read and convert this much of a tensor at a time


class WeightsError(ValueError):
    """A weights file is missing, truncated, corrupt or does not hold what the config says."""


def check_f16_range(values: np.ndarray, file: str, name: str) -> None:
    """Raise ``WeightsError`` naming ``file`` and tensor ``name`` when ``values`` (f32) hold a value beyond
    float16's range, or NaN: fleet stores float16 weights, and such a value would turn into inf."""
    peak = float(np.abs(values).max(initial=0))
    if not peak <= F16_MAX:  # also catches NaN
        raise WeightsError(f"{file}: tensor {name} has values beyond float16's range (max |x| {peak:.3g}); "
                           "fleet stores float16 weights")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``file``, byte ``offset`` from the file's start, dtype and shape."""

    file: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype][1]


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Validate ``path``'s header (the safetensors library) and return its tensors' locations."""
    from safetensors import SafetensorError, safe_open

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise WeightsError(f"{path}: truncated ({size} bytes): not a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > min(size - 8, 100 << 20):
                raise WeightsError(f"{path}: corrupt or truncated safetensors header (says {length} bytes, "
                                   f"the file has {size})")
            header = json.loads(fh.read(length))
        with safe_open(str(path), framework="numpy"):
            pass  # the library's own checks: offsets cover the data exactly, known dtypes
    except FileNotFoundError:
        raise WeightsError(f"{path}: file missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: corrupt safetensors header ({exc})") from None
    except SafetensorError as exc:
        raise WeightsError(f"{path}: corrupt or truncated safetensors file ({exc})") from None
    data_start = 8 + length
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in DTYPES:
            raise WeightsError(f"{path}: tensor {name} is {entry['dtype']}; the builder reads bf16, f16 and f32")
        info = TensorInfo(path, data_start + begin, entry["dtype"], tuple(entry["shape"]))
        if info.nbytes != end - begin or data_start + end > size:
            raise WeightsError(f"{path}: tensor {name} does not fit the file (truncated?)")
        infos[name] = info
    return infos


def check_shapes(tensors: dict, expected: dict[str, tuple[int, ...]], folder: Path, where: str) -> None:
    """Raise ``WeightsError`` unless every name in ``expected`` is in ``tensors`` (objects with ``shape``,
    and ``file`` where known) with that shape, naming the file, the tensor and both shapes."""
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            raise WeightsError(f"{folder}: tensor {name} missing, though {where} implies it")
        if tuple(info.shape) != tuple(shape):
            file = getattr(info, "file", folder).name
            raise WeightsError(f"{file}: tensor {name} is {list(info.shape)}, but {where} implies {list(shape)}: "
                               "config and weights do not match")


class SafetensorsWeights:
    """The tensors of an HF model folder's ``model.safetensors`` or ``model.safetensors.index.json``.

    Raises ``WeightsError`` when the folder has neither, the index names a missing file, or a file
    is corrupt or truncated.
    """

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        self.folder = folder
        index = folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
                raise WeightsError(f"{index}: not a safetensors index ({exc})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise WeightsError(f"{index}: not a safetensors index (no 'weight_map' of tensor names to files)")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise WeightsError(f"{index} names {len(missing)} file(s) not in {folder}: {', '.join(missing[:4])}")
        elif (folder / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise WeightsError(f"{folder} has no {SINGLE_NAME} or {INDEX_NAME} (the builder reads safetensors)")
        headers = {name: _read_header(folder / name) for name in files}
        if weight_map is None:
            self.tensors: dict[str, TensorInfo] = headers[SINGLE_NAME]
        else:  # each tensor from the file the index names, and only there
            self.tensors = {}
            for name, file in weight_map.items():
                if name not in headers[file]:
                    raise WeightsError(f"{index} puts {name} in {file}, which does not hold it")
                self.tensors[name] = headers[file][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def kind(self, name: str) -> str:
        """How the builder stores ``name``: always ``"f16"`` (``gguf.GGUFWeights.kind`` has more)."""
        return "f16"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def check(self, expected: dict[str, tuple[int, ...]], where: str = "config.json") -> None:
        """Raise ``WeightsError`` unless every name in ``expected`` is here with that shape."""
        check_shapes(self.tensors, expected, self.folder, where)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as stored (f16 or f32; ``WeightsError`` for bf16, which numpy cannot hold)."""
        info = self.tensors[name]
        if info.dtype == "BF16":
            raise WeightsError(f"{info.file.name}: tensor {name} is bf16; numpy arrays cannot hold it as stored")
        return np.array(np.memmap(info.file, dtype=DTYPES[info.dtype][0], mode="r", offset=info.offset,
                                  shape=info.shape))

    def kernel_type(self, name: str) -> str | None:
        """The type fleet's kernels multiply matrix ``name`` in (fleet_common/kernels.py ``BLOCK_TYPES``): its
        dtype as stored, ``F16`` or ``BF16``; an F32 matrix as ``F16`` (fleet stores float16 weights, as every
        other form of this builder does); None for a tensor that is not a matrix."""
        info = self.tensors[name]
        return None if len(info.shape) != 2 else "F16" if info.dtype == "F32" else info.dtype

    def row_bytes(self, name: str) -> int:
        """Bytes a row of matrix ``name`` takes in ``kernel_type`` (2 a value); nothing is read."""
        return 2 * int(np.prod(self.tensors[name].shape[1:], dtype=np.int64))

    def block_bytes(self, name: str) -> np.ndarray:
        """Matrix ``name``'s bytes in ``kernel_type``, u8 [rows, cols x 2], read now: F16 and BF16 as stored,
        F32 as float16 (``tensor``). ``WeightsError`` when the file cannot be read, or a value is inf or NaN
        (an F32 one beyond float16's range)."""
        info = self.tensors[name]
        if info.dtype == "F32":
            return self.tensor(name).view(np.uint8)
        try:
            bits = np.array(np.memmap(info.file, dtype=np.uint16, mode="r", offset=info.offset, shape=info.shape))
        except (OSError, ValueError) as exc:
            raise WeightsError(f"{info.file}: tensor {name} cannot be read ({exc})") from None
        exponent = np.uint16(0x7C00 if info.dtype == "F16" else 0x7F80)  # all ones: inf or NaN
        if ((bits & exponent) == exponent).any():
            raise WeightsError(f"{info.file.name}: tensor {name} holds inf or NaN values")
        return bits.view(np.uint8)

    def row_order(self, name: str) -> None:
        """None: a safetensors matrix's rows are in HF's order (``gguf.GGUFWeights.row_order`` has more)."""
        return None

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes as f16 (what a build writes)."""
        return int(np.prod(self.tensors[name].shape, dtype=np.int64)) * 2

    def tensor(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``name`` (or its rows ``[start, stop)`` of the first axis) as a float16 array, written into
        ``out`` (float16, that shape) when given. Read now, from the mapped file, ``CHUNK_BYTES`` at a
        time, so converting a 1 GiB embedding needs no f32 copy of it.

        Raises ``WeightsError`` when a value is beyond float16's range or the file cannot be read.
        """
        info = self.tensors[name]
        dtype, width = DTYPES[info.dtype]
        shape = info.shape
        first, offset = 0, info.offset
        if rows is not None:
            row = int(np.prod(shape[1:], dtype=np.int64))
            first, stop = rows
            shape, offset = (stop - first, *shape[1:]), info.offset + first * row * width
        if out is None:
            out = np.empty(shape, dtype=np.float16)
        flat, total = out.reshape(-1), out.size
        step = max(1, CHUNK_BYTES // width)
        for start in range(0, total, step):
            count = min(step, total - start)
            try:
                raw = np.memmap(info.file, dtype=dtype, mode="r", offset=offset + start * width, shape=(count,))
            except (OSError, ValueError) as exc:
                raise WeightsError(f"{info.file}: tensor {name} cannot be read ({exc})") from None
            if info.dtype == "F16":
                flat[start:start + count] = raw
                continue
            wide = (raw.astype(np.uint32) << 16).view(np.float32) if info.dtype == "BF16" else raw
            check_f16_range(wide, info.file.name, name)
            flat[start:start + count] = wide
            del raw, wide
        return out
