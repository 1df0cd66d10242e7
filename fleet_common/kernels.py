"""fleet's own kernels: the OpenVINO extension (``kernels/``, built by ``pip install .``) that multiplies a
GGUF tensor's blocks where they lie, and what every ``ov.Core`` that reads a stage needs of it.

The library sits beside this file (``libfleet_kernels.so``); it is built against the pinned openvino wheel
(its ABI is that release's) and reports its build version, which must equal ``KERNELS_VERSION``: a stage
built for version N names it in the manifest and a worker without that build refuses the stage.

The ops (opset ``fleet_gguf``): ``GgufMatMul``, activations f32 [..., K] x the tensor's bytes (a u8 Constant
[N, row bytes], GGUF's own layout) -> f32 [..., N], or x several tensors' (one output each); ``GgufMoeMatMul``, the same for each token's chosen
experts of an expert tensor [E, N, row bytes]; ``GgufEmbedding``, rows of a table kept as blocks;
``GgufSparseFfn``, an FFN that computes only the neurons whose gate fires (``gguf_sparse_ffn``). Attributes
``block_type`` (GGUF's name) and ``precision`` ("int8": activations quantized to int8 per 32 values,
llama.cpp's speed; "f32": exact). docs/design-kernels.md describes the kernels.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np
import openvino as ov

KERNELS_VERSION = "4"  # kernels/VERSION: bump when the op's meaning (its numbers) or the library's interface changes
OPSET = "fleet_gguf"
LIBRARY = Path(__file__).with_name("libfleet_kernels.so")
PRECISIONS = ("int8", "f32")
BLOCK_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
DOWN_T_TYPES = ("Q8_0", "Q4_0", "F16", "BF16", "F32")  # the sparse FFN's axpy (kernels/core/sparse.h)
ACTIVATIONS = ("relu", "silu")
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")
PRODUCTS = ("GgufMatMul", "GgufMoeMatMul", "GgufSparseFfn")  # the ops with a ``precision`` (runtime.kernels_at sets it)
INSTALL_HINT = "reinstall fleet with its kernels (pip install . in fleet's folder; it needs a C++ compiler and cmake)"


class KernelsUnavailable(RuntimeError):
    """The kernels library is missing, or is another build than this fleet's."""


@functools.cache
def _library() -> ctypes.CDLL:
    if not LIBRARY.exists():
        raise KernelsUnavailable(f"fleet's kernels are not built ({LIBRARY} is missing): {INSTALL_HINT}")
    lib = ctypes.CDLL(str(LIBRARY))  # openvino (imported above) has loaded libopenvino and libtbb it links
    lib.fleet_kernels_version.restype = ctypes.c_char_p
    lib.fleet_kernels_isa.restype = ctypes.c_char_p
    built = lib.fleet_kernels_version().decode()
    if built != KERNELS_VERSION:
        raise KernelsUnavailable(f"fleet's kernels library is version {built}, this fleet needs {KERNELS_VERSION}: "
                                 f"{INSTALL_HINT}")
    return lib


def library_path() -> Path:
    """The extension library's path, once checked to be this fleet's build; ``KernelsUnavailable`` if not."""
    _library()
    return LIBRARY


def available() -> bool:
    """Whether the kernels library is built and is this fleet's version."""
    try:
        _library()
    except KernelsUnavailable:
        return False
    return True


def active_isa() -> str:
    """The instruction set the kernels run on here: FLEET_KERNEL_ISA if set, else the best of ``ISAS`` this
    CPU has. ``KernelsUnavailable`` when FLEET_KERNEL_ISA names one this CPU lacks or no such set."""
    isa = _library().fleet_kernels_isa().decode()
    if not isa:
        raise KernelsUnavailable(f"FLEET_KERNEL_ISA={os.environ.get('FLEET_KERNEL_ISA')!r}: not one of {ISAS} "
                                 "that this CPU runs")
    return isa


def add_to(core: ov.Core) -> ov.Core:
    """Registers the ``fleet_gguf`` opset with ``core`` (before it reads an IR or imports a blob holding these
    ops) and returns it. ``KernelsUnavailable`` when the library is missing or of another version."""
    core.add_extension(str(library_path()))
    return core


def new_core() -> ov.Core:
    """An ``ov.Core`` with fleet's kernels registered: what every reader of a stage uses."""
    return add_to(ov.Core())


@functools.cache
def _factory():  # noqa: ANN202 - openvino.utils.node_factory.NodeFactory
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(library_path()))
    return factory


def gguf_matmul(x: ov.Output, blocks: ov.Output, block_type: str, precision: str = "int8") -> ov.Output:
    """``x @ W.T`` with W one GGUF tensor's blocks: x f32 [..., K], ``blocks`` u8 [N, K / block x block bytes]
    (GGUF's row-major bytes) -> f32 [..., N]. ``ValueError`` for a type or precision the kernels lack."""
    return gguf_matmuls(x, [blocks], [block_type], precision)[0]


def gguf_matmuls(x: ov.Output, blocks: list[ov.Output], block_types: list[str],
                 precision: str = "int8") -> list[ov.Output]:
    """``x @ W_i.T`` for several GGUF tensors of one input (a layer's q, k and v; gate and up) as one
    ``GgufMatMul``: the same products and bits as one op each, for one op's cost and one wait of the threads a
    step. x f32 [..., K]; ``blocks[i]`` u8 [N_i, row bytes] of type ``block_types[i]`` -> [f32 [..., N_i]].
    ``ValueError`` for a type or precision the kernels lack, or as many types as tensors."""
    if len(blocks) != len(block_types) or not blocks:
        raise ValueError(f"{len(blocks)} tensors but {len(block_types)} block types")
    for block_type in block_types:
        _check(block_type, precision)
    node = _factory().create("GgufMatMul", [x, *blocks], {"block_type": ",".join(block_types), "precision": precision})
    return [node.output(i) for i in range(len(blocks))]


def gguf_moe_matmul(x: ov.Output, blocks: ov.Output, chosen: ov.Output, block_type: str,
                    precision: str = "int8") -> ov.Output:
    """Each token times its chosen experts: x f32 [T, K], ``blocks`` u8 [E, N, row bytes] (a GGUF expert tensor as
    it lies), ``chosen`` i32/i64 [T, k] expert indices -> f32 [T, k, N]; only the chosen experts' blocks are read,
    each once per call. An index outside [0, E) fails the inference. ``ValueError`` as ``gguf_matmul``."""
    _check(block_type, precision)
    node = _factory().create("GgufMoeMatMul", [x, blocks, chosen], {"block_type": block_type, "precision": precision})
    return node.output(0)


def gguf_embedding(blocks: ov.Output, ids: ov.Output, block_type: str) -> ov.Output:
    """Rows of an embedding table kept as GGUF blocks: ``blocks`` u8 [V, row bytes], ``ids`` i32/i64 [...] ->
    f32 [..., K], each row dequantized exactly (the f32 precision's values). An id outside [0, V) fails the
    inference naming it. ``ValueError`` for a type the kernels lack."""
    _check(block_type, "f32")
    return _factory().create("GgufEmbedding", [blocks, ids], {"block_type": block_type}).output(0)


def gguf_sparse_ffn(x: ov.Output, gate: ov.Output, up: ov.Output, down_t: ov.Output, gate_type: str, up_type: str,
                    down_t_type: str = "Q8_0", activation: str = "relu", threshold: float = 0.0,
                    precision: str = "int8") -> ov.Output:
    """An FFN that computes only the neurons whose gate fires: x f32 [..., d]; ``gate`` and ``up`` u8 [F, row bytes]
    (GGUF row-major blocks, as ``gguf_matmul`` takes them); ``down_t`` u8 [F, row bytes], the down projection
    transposed (row i: neuron i's output column of d weights), of a type in ``DOWN_T_TYPES`` -> y f32 [..., d].

    Per row: g = x gate^T and u = x up^T (the bits of ``gguf_matmul``), a = relu(g) or silu(g) = g / (1 + exp(-g))
    (``activation``; fleet's own exp, the same bits on every CPU), neuron i kept iff |a_i| > ``threshold`` (>= 0;
    relu: g_i > threshold), y = sum over the kept i, ascending, of a_i u_i down_t[i] (in f32 fmas;
    kernels/core/sparse.h). up and down_t are read only on the kept neurons (the union over the rows). A row's y
    does not depend on the other rows or the thread count. ``ValueError`` for a type, activation, threshold or
    precision the op does not take; shape errors are refused by the op naming the problem (``RuntimeError``)."""
    _check(gate_type, precision)
    _check(up_type, precision)
    if down_t_type not in DOWN_T_TYPES:
        raise ValueError(f"the sparse FFN's down_t must be one of {', '.join(DOWN_T_TYPES)}, not {down_t_type}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if not threshold >= 0:
        raise ValueError(f"threshold {threshold} is not >= 0 (a neuron is kept where |a(gate)| > threshold)")
    attrs = {"gate_type": gate_type, "up_type": up_type, "down_t_type": down_t_type, "precision": precision,
             "activation": activation, "threshold": float(threshold)}
    return _factory().create("GgufSparseFfn", [x, gate, up, down_t], attrs).output(0)


def _check(block_type: str, precision: str) -> None:
    if block_type not in BLOCK_TYPES:
        raise ValueError(f"fleet's kernels do not run {block_type} blocks (they run {', '.join(BLOCK_TYPES)})")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")


def blocks_constant(data: np.ndarray) -> ov.Output:
    """A u8 Constant [N, row bytes] over ``data`` (shared, not copied: the caller keeps it alive)."""
    return ov.op.Constant(ov.Tensor(np.ascontiguousarray(data, dtype=np.uint8)), shared_memory=True).output(0)
