"""Build one layer range of a decoder-only model as a stateful OpenVINO IR shard, with OpenVINO's opset
API (no torch): one small function per block, like gpt-fast's ``model.py``.

The shard graph:

* inputs: ``input_ids`` [B, S] i64 (stage 0) or ``hidden_states`` [B, S, H] f32 (later stages);
  ``attention_mask`` [B, P+S] i64 over *physical* KV slots (1 = visible, 0 = hidden, e.g. a
  rejected draft token); ``position_ids`` [B, S] i64 *logical* positions; ``beam_idx`` [B] i32;
  last stage only: ``logits_index`` [K] i64, the positions of the chunk whose logits are wanted.
* outputs: ``hidden_states`` [B, S, H] f32, or ``logits`` [B, K, V] f32 on the last stage.
  ``export_stage(..., logits_index_input=False)`` drops ``logits_index`` and the last stage emits
  ``logits`` [B, S, V] for every position: the optimum-intel contract OpenVINO GenAI expects.
* KV cache: one ReadValue/Assign state pair per layer and per K/V, each read going
  ``ReadValue -> Gather(beam_idx, axis 0) -> Concat -> SDPA``. That exact chain is what the CPU
  plugin's ``StatefulSDPAFusion`` (and the GPU plugin's ``IndirectKVCache``) match; without the
  Gather nothing fails but decode runs 1.6-2.6x slower (Berenbaum & Venkatachalam, arXiv 2608.19147;
  the same trick as optimum-intel's ``fuse_cache_reorder``). Grouped KV heads reach SDPA through
  ``Unsqueeze -> Broadcast -> Reshape`` (transformers' ``repeat_kv``), which the fusion also matches.
* ``rt_info["runtime_options"]["KV_CACHE_PRECISION"]``: the KV precision the stage is compiled with.

The 4-D causal + visibility mask is built inside the graph from ``attention_mask``: query ``i`` of
the chunk (physical slot ``P + i``) sees slot ``j`` iff ``j <= P + i`` and ``attention_mask[j] == 1``;
a local (sliding-window) layer of Gemma 3 also hides the keys ``sliding_window`` or more logical positions
back (``window_mask``).

Weights are float16 ``Constant -> Convert(f32)`` (the layout ``save_model(compress_to_fp16=True)``
writes), or NNCF's per-channel int8 decompression, or a GGUF's own blocks (``_Weights``). Each is a
``PostponedConstant`` whose maker reads the tensor from the source only when
``ov.save_model`` writes it, so a stage's build holds one tensor at a time, never the stage
(openvino/utils/postponed_constant.py: the serializer calls the maker when it writes the constant and
drops the data once written). Save with
``compress_to_fp16=False``: the weights already are f16, and RoPE's frequencies stay f32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as op
from openvino.utils.postponed_constant import make_postponed_constant

from fleet_common import kernels as fleet_kernels  # the parameter `kernels` below is a flag

from .arch import EMBEDDING, FINAL_NORM, LM_HEAD, ModelConfig, expected_shapes, hf_weight_names
from .experts import GgufExperts, expert_rows, feed_forward, stacked_name
from .layers import (
    GgufWeight,
    attention,
    f32,
    gemma_layer,
    i64,
    linear,
    norm_weight,
    rms_norm,
    rope_tables,
    visibility_mask,
    window_mask,
)
from .sparse_ffn import SparseFfn

log = logging.getLogger(__name__)

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # the linear weights of a layer (int8 compresses them)
CODE_TYPES = {"i8": ov.Type.i8, "u8": ov.Type.u8, "i4": ov.Type.i4, "u4": ov.Type.u4, "f4e2m1": ov.Type.f4e2m1}


@dataclass(frozen=True)
class StageSpec:
    """What one exported shard covers: layers ``[start, end)`` of a ``num_layers`` model."""

    index: int
    start: int
    end: int
    num_layers: int

    @property
    def first(self) -> bool:
        """Whether the stage starts at layer 0 (it takes ``input_ids`` and holds the embedding)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Whether the stage ends at the last layer (it holds the final norm and LM head)."""
        return self.end == self.num_layers


class WeightSource:
    """What the builder reads weights from: ``tensor(name, out=None)`` -> float16 array, ``shape(name)``
    and ``check(expected)`` (compiler/weights.py); ``on_read(name, nbytes)`` is called after each read."""


def stage_tensors(cfg: ModelConfig, stage: StageSpec) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every tensor stage ``stage`` reads (the tied embedding on the last stage)."""
    shapes: dict[str, tuple[int, ...]] = {}
    table = (cfg.vocab_size, cfg.hidden_size)
    if stage.first:
        shapes[EMBEDDING] = table
    for layer in range(stage.start, stage.end):
        shapes |= expected_shapes(cfg, layer)
    if stage.last:
        shapes[FINAL_NORM] = (cfg.hidden_size,)
        shapes[EMBEDDING if cfg.tie_word_embeddings else LM_HEAD] = table
    return shapes


def linear_weights(cfg: ModelConfig, stage: StageSpec) -> list[str]:
    """HF names of the linear weights stage ``stage`` multiplies by (attention's and the MLP's matrices or the
    experts', the LM head or the tied embedding on the last stage): what ``export_stage(kernels=True)`` hands
    fleet's kernels where their type allows."""
    names = [name for layer in range(stage.start, stage.end)
             for role, name in hf_weight_names(cfg, layer).items() if role in MATRICES or role.startswith("expert.")]
    if stage.last:
        names.append(EMBEDDING if cfg.tie_word_embeddings else LM_HEAD)
    return names


class _Weights:
    """Postponed constants (one set per tensor, shared by every use) for one stage's graph: f16, or with
    ``int8`` (a ``compress.WeightSpec``) linear and embedding weights as NNCF's per-channel int8 pattern, or
    with ``int4`` (``{name: (NNCF mode, group size)}``, ``compress.int4_plan``) each named weight as NNCF's
    int4 or int8 pattern."""

    def __init__(self, source, on_read: Callable[[str, int], None] | None, int8=None,  # noqa: ANN001
                 keep_blocks: bool = False, int4: dict[str, tuple[str, int]] | None = None,
                 kernels: bool = False, sparse_ffn: SparseFfn | None = None) -> None:
        self.source, self.on_read, self.int8, self.keep_blocks = source, on_read, int8, keep_blocks
        self.int4, self.kernels, self.sparse_ffn = int4, kernels, sparse_ffn
        self.nodes: dict[str, ov.Output] = {}
        self.constants: list[ov.Node] = []  # the Python ops must outlive the graph: their maker is Python

    def _postponed(self, dtype: ov.Type, shape: list[int], maker: Callable[[], ov.Tensor], name: str) -> ov.Node:
        const = make_postponed_constant(dtype, ov.Shape(shape), maker, name)
        self.constants.append(const)
        return const

    def _read(self, name: str, tensor: ov.Tensor) -> ov.Tensor:
        """``tensor`` (read for ``name``), reported to ``on_read`` at 2 bytes per weight whatever it is stored
        as, the unit the build's progress totals count in (``save.stage_fp16_bytes``)."""
        if self.on_read is not None:
            self.on_read(name, 2 * math.prod(self.source.shape(name)))
        return tensor

    @staticmethod
    def _once(make: Callable[[], dict[str, ov.Tensor]]) -> Callable[[str], ov.Tensor]:
        """A getter of the parts (weights, scale, zero point) of one compressed weight: ``make`` runs when
        the serializer asks for the first part, and each part is handed out once and then dropped, so a
        stage never holds its compressed weights whole."""
        parts: dict[str, ov.Tensor] = {}

        def get(part: str) -> ov.Tensor:
            if not parts:
                parts.update(make())
            return parts.pop(part)

        return get

    def __call__(self, name: str, matrix: bool = False, table: bool = False) -> ov.Output | GgufWeight:
        """``name`` as an f32 graph value [shape]: Constant(f16) -> Convert(f32), or for a ``matrix`` (a
        linear or embedding weight [rows, cols]) of an int8 stage the decompression NNCF writes,
        Constant(u8) -> Convert(f16) -> Subtract(zero point) -> Multiply(scale) -> Convert(f32), or a
        GGUF's own blocks (``_kept``; the embedding's Gather asks for a ``table``), or with ``kernels`` a matrix
        as its bytes for fleet's kernels (a ``GgufWeight``, ``_blocks``)."""
        if matrix and self.kernels and (block_type := self.source.kernel_type(name)) is not None:
            if (name, "kernel") not in self.nodes:
                self.nodes[(name, "kernel")] = self._blocks(name, block_type)
            return self.nodes[(name, "kernel")]
        kind = self.source.kind(name)
        kept = (matrix or table) and self.keep_blocks and kind not in ("f16", "f32")
        shape = list(self.source.shape(name))
        if name in self.nodes:
            return self.nodes[name]
        if kept:
            self.nodes[name] = self._kept(name, shape)
            return self.nodes[name]
        matrix = matrix or table
        if matrix and self.int8 is not None:
            self.nodes[name] = self._int8(name, shape, self.int8.symmetric)
            return self.nodes[name]
        if matrix and self.int4 is not None and name in self.int4:
            mode, group = self.int4[name]
            self.nodes[name] = (self._int8(name, shape, mode.endswith("_sym")) if mode.startswith("int8") else
                                self._int4(name, shape, mode.endswith("_sym"), group))
            return self.nodes[name]
        dtype = ov.Type.f32 if kind == "f32" and not matrix else ov.Type.f16

        def maker() -> ov.Tensor:
            tensor = ov.Tensor(dtype, ov.Shape(shape))
            self.source.tensor(name, out=tensor.data)  # read straight into the tensor: no second copy
            return self._read(name, tensor)

        const = self._postponed(dtype, shape, maker, name)
        self.nodes[name] = (const if dtype == ov.Type.f32 else op.convert(const, ov.Type.f32)).output(0)
        return self.nodes[name]

    def down_t(self, name: str) -> GgufWeight:
        """The down projection ``name`` [H, F] transposed for the sparse FFN (compiler/down_t.py): a u8 Constant
        [F, row bytes], made when the serializer writes it."""
        from .down_t import down_t, down_t_form

        shape, block_type = down_t_form(self.source, name)

        def maker() -> ov.Tensor:
            tensor = ov.Tensor(ov.Type.u8, ov.Shape(list(shape)))
            tensor.data[:] = down_t(self.source, name)[0]
            return self._read(name, tensor)

        return GgufWeight(self._postponed(ov.Type.u8, list(shape), maker, f"{name}_t").output(0), block_type)

    def _blocks(self, name: str, block_type: str) -> GgufWeight:
        """A linear weight as its tensor's bytes exactly as the source stores them (a GGUF's blocks, rows in the
        file's order; a row range of a fused tensor), a u8 Constant [rows, row bytes] for fleet's ``GgufMatMul``,
        read when the serializer writes it."""
        rows, width = self.source.shape(name)[0], self.source.row_bytes(name)

        def maker() -> ov.Tensor:
            tensor = ov.Tensor(ov.Type.u8, ov.Shape([rows, width]))
            tensor.data[:] = self.source.block_bytes(name)
            return self._read(name, tensor)

        blocks = self._postponed(ov.Type.u8, [rows, width], maker, name).output(0)
        return GgufWeight(blocks, block_type, self.source.row_order(name))

    def _kept(self, name: str, shape: list[int]) -> ov.Output:
        """A GGUF weight [rows, cols] in OpenVINO's compressed form of its blocks (compiler/gguf.py; a GPU/NPU
        stage's matrices, and every stage's embedding Gather): Constant(i8|u8|i4|u4 [rows, cols/g, g],
        ``gguf.STORED``) -> Convert(f32) [-> Subtract(zero point f32 [rows, cols/g, 1])] -> Multiply(scale f32
        [rows, cols/g, 1]) -> Reshape [rows, cols], g = 32 (16 for Q6_K and Q2_K's offsets), the compressed-weight
        pattern the plugins run as is. The offset types (``gguf.WITH_OFFSET``: Q4_1, Q4_K, Q5_1, Q5_K, Q2_K;
        w = q * scale + offset) as ``(q - zero point) * scale`` per offset group (``QuantRows.zero_point``), zero
        point f32: exact, and the form OpenVINO's compressed Gather takes. MXFP4: Constant(f4e2m1, the file's E2M1
        codes) -> Convert(f32) -> Multiply(Convert(f32) of Constant(f8e8m0, its scale bytes)) -> Reshape."""
        from .gguf import GROUP, STORED, WITH_OFFSET, offset_group, pack_nibbles

        kind = self.source.kind(name)
        rows, cols = shape
        offset = kind in WITH_OFFSET
        g = offset_group(kind) if offset else GROUP[kind]  # codes, scale and zero point per offset group
        groups = [rows, cols // g, 1]
        wtype = CODE_TYPES[STORED[kind]]
        nibbles, fp4 = STORED[kind] in ("i4", "u4", "f4e2m1"), STORED[kind] == "f4e2m1"

        def make() -> dict[str, ov.Tensor]:
            weights = ov.Tensor(wtype, ov.Shape([rows, cols // g, g]))
            scale, zero = np.empty(groups, np.uint8 if fp4 else np.float32), np.empty(groups, np.float32)
            raw = weights.data.view(np.int8 if wtype == ov.Type.i8 else np.uint8).reshape(rows, -1)
            step = max(1, (32 << 20) // cols)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                q = self.source.blocks(name, (a, b))
                values, scales = (q.e2m1, q.e8m0) if fp4 else (q.values, q.scale)
                if offset:
                    values, zero[a:b, :, 0], scales = q.zero_point()
                raw[a:b] = (pack_nibbles(values) if nibbles else values).reshape(b - a, -1)
                scale[a:b, :, 0] = scales
            parts = {"weights": self._read(name, weights), "scale": ov.Tensor(scale)}
            if fp4:  # the E8M0 bytes as OpenVINO's f8e8m0 (the same encoding)
                parts["scale"] = ov.Tensor(ov.Type.f8e8m0, ov.Shape(groups))
                parts["scale"].data.view(np.uint8)[...] = scale
            return parts | ({"zero_point": ov.Tensor(zero)} if offset else {})

        compute = self._once(make)
        q = self._postponed(wtype, [rows, cols // g, g], lambda: compute("weights"), name)
        x = op.convert(q, ov.Type.f32)
        if offset:
            zp = self._postponed(ov.Type.f32, groups, lambda: compute("zero_point"), f"{name}/zero_point")
            x = op.subtract(x, zp, name=f"{name}/zero_point/subtract")
        if fp4:
            scale = op.convert(self._postponed(ov.Type.f8e8m0, groups, lambda: compute("scale"), f"{name}/scale"),
                               ov.Type.f32)
        else:
            scale = self._postponed(ov.Type.f32, groups, lambda: compute("scale"), f"{name}/scale")
        x = op.multiply(x, scale, name=f"{name}/fq_weights_1")
        return op.reshape(x, i64([rows, cols]), special_zero=False).output(0)

    def stacked(self, names: list[str]) -> ov.Output:
        """The weights ``names`` (a Mixture-of-Experts layer's experts' same matrix, [rows, cols] each) as one
        constant [E, rows, cols] and its decompression chain, f32 [E, rows, cols]: the tiled block of
        compiler/layers.py ``moe``, which the CPU plugin turns into a Gather of the chosen experts inside its
        kernel. f16; with ``int8`` NNCF's per-channel int8 (codes [E, rows, cols], scale and zero point
        [E, rows, 1]); in an int4 stage (``int4`` names the stacked constant, ``stacked_name``) NNCF's int4 or
        int8 as ``compress_weights`` writes a stacked weight; a GGUF's kept blocks (``_stacked_blocks``). Read
        one expert at a time (int4: blocks of rows across the experts) when the serializer writes it."""
        rows, cols = self.source.shape(names[0])
        shape = [len(names), rows, cols]
        base = stacked_name(names)
        if self.keep_blocks and self.source.kind(names[0]) not in ("f16", "f32"):
            return self._stacked_blocks(names, base)
        if self.int4 is not None and base in self.int4:
            mode, group = self.int4[base]
            if mode.startswith("int4"):
                return self._stacked_int4(names, base, mode.endswith("_sym"), group)
            return self._stacked_int8(names, base, mode.endswith("_sym"))
        if self.int8 is not None:
            return self._stacked_int8(names, base, self.int8.symmetric)

        def maker() -> ov.Tensor:
            tensor = ov.Tensor(ov.Type.f16, ov.Shape(shape))
            for e, name in enumerate(names):
                self.source.tensor(name, out=tensor.data[e])
                self._read(name, tensor)
            return tensor

        return op.convert(self._postponed(ov.Type.f16, shape, maker, base), ov.Type.f32).output(0)

    def experts(self, names: list[str]) -> GgufExperts | None:
        """The experts ``names`` (one matrix of a Mixture-of-Experts layer, [rows, cols] each, expert 0 first) as
        their tensors' bytes for fleet's ``GgufMoeMatMul`` (compiler/experts.py): a u8 Constant [E, rows, row bytes],
        expert e's bytes as the source stores them (a GGUF's ``ffn_*_exps`` [E, rows, row bytes] as it lies), read
        when the serializer writes it. None unless this stage runs fleet's kernels and every expert is in the source
        and of one type they multiply (``kernel_type``)."""
        if not self.kernels or any(name not in self.source for name in names):
            return None
        types = {self.source.kernel_type(name) for name in names}
        if len(types) != 1 or None in types:
            return None
        base = stacked_name(names)
        if (base, "kernel") not in self.nodes:
            shape = [len(names), self.source.shape(names[0])[0], self.source.row_bytes(names[0])]

            def maker() -> ov.Tensor:
                tensor = ov.Tensor(ov.Type.u8, ov.Shape(shape))
                for e, name in enumerate(names):
                    tensor.data[e] = self.source.block_bytes(name)
                    self._read(name, tensor)
                return tensor

            self.nodes[(base, "kernel")] = GgufExperts(self._postponed(ov.Type.u8, shape, maker, base).output(0),
                                                       types.pop())
        return self.nodes[(base, "kernel")]

    def _stacked_blocks(self, names: list[str], base: str) -> ov.Output:
        """``stacked`` for a GGUF's experts of a kept block type (compiler/gguf_moe.py: each expert a slice of one
        stacked tensor, all of one type): codes [E, rows, cols / g, g] (``gguf.STORED``), scale and, for an offset
        type, a zero point f32 [E, rows, cols / g, 1] per group of g (``QuantRows.zero_point``: the form the
        compressed embedding Gather takes), decompressed as ``(codes - zero point) * scale`` and reshaped to
        [E, rows, cols] f32: exact to f32 rounding."""
        from .gguf import GROUP, STORED, WITH_OFFSET, offset_group, pack_nibbles

        kind = self.source.kind(names[0])
        (rows, cols), experts, offset = self.source.shape(names[0]), len(names), kind in WITH_OFFSET
        g = offset_group(kind) if offset else GROUP[kind]
        shape, groups = [experts, rows, cols // g, g], [experts, rows, cols // g, 1]
        wtype = CODE_TYPES[STORED[kind]]

        def make() -> dict[str, ov.Tensor]:
            weights = ov.Tensor(wtype, ov.Shape(shape))
            raw = weights.data.view(np.int8 if wtype == ov.Type.i8 else np.uint8).reshape(experts, rows, -1)
            scale, zero_point = np.empty(groups, np.float32), np.empty(groups, np.float32)
            for e, name in enumerate(names):
                q = self.source.blocks(name, (0, rows))
                values, scales = q.values, q.scale
                if offset:
                    values, zero_point[e, ..., 0], scales = q.zero_point()
                raw[e] = (pack_nibbles(values) if STORED[kind] in ("i4", "u4") else values).reshape(rows, -1)
                scale[e, ..., 0] = scales.reshape(rows, -1)
                self._read(name, weights)
            return {"weights": weights, "scale": ov.Tensor(scale)} | \
                ({"zero_point": ov.Tensor(zero_point)} if offset else {})

        compute = self._once(make)
        x = op.convert(self._postponed(wtype, shape, lambda: compute("weights"), base), ov.Type.f32)
        if offset:
            x = op.subtract(x, self._postponed(ov.Type.f32, groups, lambda: compute("zero_point"), f"{base}/zero_point"))
        x = op.multiply(x, self._postponed(ov.Type.f32, groups, lambda: compute("scale"), f"{base}/scale"))
        return op.reshape(x, i64([experts, rows, cols]), special_zero=False).output(0)

    def _stacked_int8(self, names: list[str], base: str, symmetric: bool) -> ov.Output:
        """``stacked`` at NNCF's per-channel int8: Constant(u8 | i8 [E, rows, cols]) -> Convert(f16)
        [-> Subtract(zero point u8 [E, rows, 1])] -> Multiply(scale f16 [E, rows, 1]) -> Convert(f32), each
        expert compressed by ``compress.int8_rows``."""
        from .compress import int8_rows

        rows, cols = self.source.shape(names[0])
        shape, per_row = [len(names), rows, cols], [len(names), rows, 1]
        wtype = ov.Type.i8 if symmetric else ov.Type.u8

        def make() -> dict[str, ov.Tensor]:
            weights = ov.Tensor(wtype, ov.Shape(shape))
            scale, zero_point = np.empty(per_row, np.float16), np.empty(per_row, np.uint8)
            for e, name in enumerate(names):
                s, z = int8_rows(lambda a, b, name=name: self.source.tensor(name, rows=(a, b)), (rows, cols),
                                 symmetric, weights.data[e])
                scale[e] = s
                if z is not None:
                    zero_point[e] = z
                self._read(name, weights)
            parts = {"weights": weights, "scale": ov.Tensor(scale)}
            return parts | ({} if symmetric else {"zero_point": ov.Tensor(zero_point)})

        return self._decompressed(self._once(make), base, wtype, shape, ov.Type.u8, per_row, symmetric)

    def _stacked_int4(self, names: list[str], base: str, symmetric: bool, group: int) -> ov.Output:
        """``stacked`` at NNCF's int4, the layout ``compress_weights`` gives a stacked weight: Constant(i4 | u4
        [E, rows, cols / g, g]) -> Convert(f16) [-> Subtract(zero point u4 [E, rows, cols / g, 1])] ->
        Multiply(scale f16 [E, rows, cols / g, 1]) -> Reshape [E, rows, cols] -> Convert(f32) (``group`` -1:
        [E, rows, cols] and [E, rows, 1], no Reshape). The groups lie within a row, so the matrix is compressed
        as [E * rows, cols] by ``compress.int4_rows`` in blocks of rows across the experts (the kernel NNCF
        picks for the whole stacked tensor: ``compress.row_blocks``), packed straight into the constant."""
        from .compress import int4_rows

        rows, cols = self.source.shape(names[0])
        experts = len(names)
        grouped, per_group = ([experts, rows, cols], [experts, rows, 1]) if group == -1 else \
            ([experts, rows, cols // group, group], [experts, rows, cols // group, 1])
        wtype = ov.Type.i4 if symmetric else ov.Type.u4
        read = expert_rows(self.source, names, self._read)

        def make() -> dict[str, ov.Tensor]:
            weights = ov.Tensor(wtype, ov.Shape(grouped))
            packed = weights.data.view(np.uint8).reshape(-1)
            parts = int4_rows(read, (experts * rows, cols), symmetric, group, out=packed)
            out = {"weights": weights, "scale": ov.Tensor(parts["scale"].reshape(per_group))}
            if not symmetric:
                out["zero_point"] = ov.Tensor(ov.Type.u4, ov.Shape(per_group))
                out["zero_point"].data[:] = parts["zero_point"]
            return out

        return self._decompressed(self._once(make), base, wtype, grouped, ov.Type.u4, per_group, symmetric,
                                  None if group == -1 else [experts, rows, cols])

    def _decompressed(self, compute: Callable[[str], ov.Tensor], name: str, wtype: ov.Type, shape: list[int],
                      zp_type: ov.Type, per_group: list[int], symmetric: bool,
                      reshape: list[int] | None = None) -> ov.Output:
        """NNCF's decompression subgraph of a compressed weight (its OpenVINO backend's): Constant(``wtype``
        ``shape``) -> Convert(f16) [-> Subtract(Convert(zero point ``zp_type`` ``per_group``)), unless
        ``symmetric``] -> Multiply(scale f16 ``per_group``) [-> Reshape ``reshape``] -> Convert(f32), the
        constants ``compute``'s "weights", "zero_point" and "scale", named after ``name``."""
        x = op.convert(self._postponed(wtype, shape, lambda: compute("weights"), name), ov.Type.f16)
        if not symmetric:
            zp = self._postponed(zp_type, per_group, lambda: compute("zero_point"), f"{name}/zero_point")
            x = op.subtract(x, op.convert(zp, ov.Type.f16), name=f"{name}/zero_point/subtract")
        scale = self._postponed(ov.Type.f16, per_group, lambda: compute("scale"), f"{name}/scale")
        x = op.multiply(x, scale, name=f"{name}/fq_weights_1")
        if reshape is not None:
            x = op.reshape(x, i64(reshape), special_zero=False)
        return op.convert(x, ov.Type.f32).output(0)

    def _int8(self, name: str, shape: list[int], symmetric: bool) -> ov.Output:
        """The three constants of one int8 weight, computed together when the serializer asks for the first
        and each handed out once (so the stage is never held compressed whole)."""
        from .compress import int8_rows

        def make() -> dict[str, ov.Tensor]:
            weights = ov.Tensor(ov.Type.i8 if symmetric else ov.Type.u8, ov.Shape(shape))
            scale, zero_point = int8_rows(lambda a, b: self.source.tensor(name, rows=(a, b)), tuple(shape),
                                          symmetric, weights.data)
            parts = {"weights": self._read(name, weights), "scale": ov.Tensor(scale)}
            return parts | ({} if zero_point is None else {"zero_point": ov.Tensor(zero_point)})

        return self._decompressed(self._once(make), name, ov.Type.i8 if symmetric else ov.Type.u8, shape,
                                  ov.Type.u8, [shape[0], 1], symmetric)

    def _int4(self, name: str, shape: list[int], symmetric: bool, group: int) -> ov.Output:
        """One int4 weight [rows, cols] as NNCF writes it (its OpenVINO backend's compression subgraph):
        Constant(i4 | u4 [rows, cols / g, g]) -> Convert(f16) [-> Subtract(zero point u4 [rows, cols / g, 1])]
        -> Multiply(scale f16 [rows, cols / g, 1]) -> Reshape [rows, cols] -> Convert(f32); ``group`` -1: one
        group per row, [rows, cols] and [rows, 1], no Reshape. Computed by ``compress.int4_rows`` when the
        serializer asks for the first part."""
        from .compress import int4_rows

        rows, cols = shape
        grouped, per_group = ([rows, cols], [rows, 1]) if group == -1 else \
            ([rows, cols // group, group], [rows, cols // group, 1])
        wtype = ov.Type.i4 if symmetric else ov.Type.u4

        def make() -> dict[str, ov.Tensor]:
            parts = int4_rows(lambda a, b: self.source.tensor(name, rows=(a, b)), (rows, cols), symmetric, group)
            weights = ov.Tensor(wtype, ov.Shape(grouped))
            weights.data[:] = parts["weights"]
            out = {"weights": self._read(name, weights), "scale": ov.Tensor(parts["scale"].reshape(per_group))}
            if not symmetric:
                out["zero_point"] = ov.Tensor(ov.Type.u4, ov.Shape(per_group))
                out["zero_point"].data[:] = parts["zero_point"]
            return out

        return self._decompressed(self._once(make), name, wtype, grouped, ov.Type.u4, per_group, symmetric,
                                  None if group == -1 else [rows, cols])


def name_products(model: ov.Model) -> None:
    """Name every MatMul whose weight comes from a named constant after that weight (``model.layers.3.mlp.
    down_proj.weight/matmul``, as ``linears`` names fleet's kernels' products), so a per-op profile (``PERF_COUNT``)
    says which matrix each FullyConnected is (bench/kernels/kernel_bench.py)."""
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        source = node.input(1).get_source_output().get_node()
        while source.get_type_name() in ("Reshape", "Multiply", "Subtract", "Convert"):
            source = source.input(0).get_source_output().get_node()
        if source.get_input_size() == 0 and source.get_type_name() != "Parameter":  # a (postponed) constant
            node.set_friendly_name(f"{source.get_friendly_name()}/matmul")


def _parameter(name: str, shape: list[int], dtype: ov.Type) -> ov.Node:
    param = op.parameter(ov.PartialShape(shape), dtype, name=name)
    param.output(0).get_tensor().set_names({name})
    return param


def _embedding(weights: _Weights, source, ids: ov.Node) -> ov.Output:  # noqa: ANN001 - a weight source
    """The token embedding's rows [B, S, H] of ``ids`` [B, S]: taken from the table's bytes by fleet's
    ``GgufEmbedding`` where a kernels stage holds it as blocks (no second copy; one Constant with a tied LM head),
    else a Gather of its ``table`` form."""
    table = weights(EMBEDDING, matrix=True) if weights.kernels and source.kernel_type(EMBEDDING) else None
    if isinstance(table, GgufWeight) and table.order is None:  # the rows as they lie in the file
        return fleet_kernels.gguf_embedding(table.blocks, ids, table.block_type)
    return op.gather(weights(EMBEDDING, table=True), ids, i64(0)).output(0)


def export_stage(cfg: ModelConfig, source, stage: StageSpec, kv_cache_precision: str = "f16", *,  # noqa: ANN001
                 logits_index_input: bool = True, on_read: Callable[[str, int], None] | None = None,
                 int8=None, keep_blocks: bool = False,
                 int4: dict[str, tuple[str, int]] | None = None, kernels: bool = False,
                 sparse_ffn: SparseFfn | None = None) -> ov.Model:  # noqa: ANN001
    """The stateful ``ov.Model`` of layers ``[stage.start, stage.end)`` of ``cfg``, weights from ``source``
    (``compiler.weights.SafetensorsWeights`` or any object with its ``tensor``/``shape``/``check``), with
    the input/output contract in this module's docstring.

    Nothing is read until ``ov.save_model`` writes the model (then ``on_read(name, nbytes)`` follows
    each tensor). ``kv_cache_precision`` goes to ``rt_info["runtime_options"]["KV_CACHE_PRECISION"]``
    as optimum-intel does (without it the CPU plugin picks u8 KV and shards drift from the whole
    model). ``logits_index_input=False`` (last stage only): no ``logits_index`` input, logits for
    every position [B, S, V], as OpenVINO GenAI's ``LLMPipeline`` expects of ``openvino_model.xml``.
    ``int8`` (a ``compiler.compress.WeightSpec`` of format int8): every linear and embedding weight is
    written in NNCF's per-channel int8 form as it is read (``compress.int8_rows``), norms and biases f16.
    ``int4`` (``compress.int4_plan``, ``{name: (NNCF mode, group size)}``): each weight it names in NNCF's
    int4 (``compress.int4_rows``) or int8 form as it is read, the rest f16.
    ``keep_blocks`` (a GGUF source, compiler/gguf.py): its weights of a kept type (``gguf.KEPT``) keep their
    blocks. ``kernels`` (a CPU stage of a GGUF): every linear weight and the LM head of a type fleet's kernels
    run (``fleet_common.kernels.BLOCK_TYPES``) is its tensor's bytes as they lie in the file, multiplied by
    ``GgufMatMul`` (``_Weights._blocks``), its embedding rows too (``_embedding``), its experts by ``GgufMoeMatMul``
    where all of a layer's are of such a type (compiler/experts.py); with ``sparse_ffn`` each dense MLP is one
    ``GgufSparseFfn`` (compiler/sparse_ffn.py: its masks or thresholds). Raises ``WeightsError`` for a missing or misshapen tensor."""
    source.check(stage_tensors(cfg, stage))
    weights = _Weights(source, on_read, int8, keep_blocks, int4, kernels, sparse_ffn)
    if stage.first:
        first = _parameter("input_ids", [-1, -1], ov.Type.i64)
        x = _embedding(weights, source, first)  # [B, S, H]
        if cfg.embed_scale != 1.0:  # Gemma: x sqrt(hidden)
            x = op.multiply(x, f32(cfg.embed_scale)).output(0)
    else:
        first = _parameter("hidden_states", [-1, -1, cfg.hidden_size], ov.Type.f32)
        x = first.output(0)
    attention_mask = _parameter("attention_mask", [-1, -1], ov.Type.i64)
    position_ids = _parameter("position_ids", [-1, -1], ov.Type.i64)
    beam_idx = _parameter("beam_idx", [-1], ov.Type.i32)
    params = [first, attention_mask, position_ids, beam_idx]
    first_shape = op.shape_of(first, output_type="i64")
    batch = op.gather(first_shape, i64([0]), i64(0)).output(0)
    seq = op.gather(first_shape, i64(1), i64(0)).output(0)
    mask = visibility_mask(attention_mask.output(0), seq)
    rope = rope_tables(position_ids.output(0), cfg)
    if any(cfg.sliding_layers[stage.start:stage.end]):  # Gemma 3's, gpt-oss's local layers: RoPE base, window
        local_rope = rope if cfg.local_inv_freq == cfg.inv_freq else \
            rope_tables(position_ids.output(0), cfg, cfg.local_inv_freq)
        local = (local_rope, window_mask(attention_mask.output(0), seq, mask, cfg.sliding_window))
    sinks: list[ov.Node] = []
    for layer in range(stage.start, stage.end):
        names = hf_weight_names(cfg, layer)
        # an int4 stage compresses the router as NNCF does (int4_plan names it); otherwise it stays f16
        w = {role: weights(name, matrix=role in MATRICES or (role == "router" and int4 is not None))
             for role, name in names.items() if not role.startswith("expert.")}
        sliding = bool(cfg.sliding_layers) and cfg.sliding_layers[layer]  # Gemma 3's, gpt-oss's local layers
        here = local if sliding else (rope, mask)
        if cfg.sandwich_norms:  # Gemma 3
            x, layer_sinks = gemma_layer(x, w, cfg, *here, beam_idx.output(0), batch, layer, sliding)
            sinks += layer_sinks
            continue
        h, layer_sinks = attention(rms_norm(x, w["input_norm"], cfg.rms_norm_eps), w, cfg, *here,
                                   beam_idx.output(0), batch, layer, sliding)
        x = op.add(x, h).output(0)
        x = op.add(x, feed_forward(rms_norm(x, w["post_norm"], cfg.rms_norm_eps), w, names, weights, cfg,
                                    layer)).output(0)
        sinks += layer_sinks
    if stage.last:
        if logits_index_input:
            logits_index = _parameter("logits_index", [-1], ov.Type.i64)
            params.append(logits_index)
            x = op.gather(x, logits_index, i64(1)).output(0)  # [B, K, H]
        x = rms_norm(x, norm_weight(weights(FINAL_NORM), cfg), cfg.rms_norm_eps)
        x = linear(x, weights(EMBEDDING if cfg.tie_word_embeddings else LM_HEAD, matrix=True))  # [B, K, V]
    result = op.result(x)
    result.output(0).get_tensor().set_names({"logits" if stage.last else "hidden_states"})
    model = ov.Model([result], sinks, params, f"stage_{stage.index}")
    name_products(model)
    model.set_rt_info(kv_cache_precision, ["runtime_options", "KV_CACHE_PRECISION"])
    model._fleet_weights = weights  # keeps the postponed constants' Python objects alive with the model
    log.info("stage %d: layers [%d, %d) built", stage.index, stage.start, stage.end)
    return model
