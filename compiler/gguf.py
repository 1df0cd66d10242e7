"""GGUF files as a weight source of the stage builder: memory-mapped (gguf-py's ``GGUFReader``), tensor by
tensor. A CPU stage hands each linear weight's bytes, as they lie in the file, to fleet's kernels (``block_bytes``,
fleet_common/kernels.py); a GPU/NPU stage, the embedding's Gather and Mixture-of-Experts experts keep quantized
blocks in forms OpenVINO's plugins run compressed (``blocks``).

Names and order: llama.cpp's tensor names map to HF's (``GGUF_TO_HF``); ggml lists dimensions innermost
first, so a GGUF [cols, rows] tensor is HF's [rows, cols]. llama.cpp's converter permutes the rows of
llama-family Q and K weights for its interleaved RoPE (``LlamaModel.permute`` in convert_hf_to_gguf.py);
they are put back in HF's order (qwen2/qwen3/phi3/gemma3 files are not permuted). gemma3 files name their four norms
a layer otherwise (``GEMMA3_LAYER_TO_HF``) and store them as 1 + w (``gemma3_config``).

OpenVINO's forms of kept blocks (``blocks``), each as integers, a per-block scale and, for Q4_1, Q4_K, Q5_1 and
Q5_K, a per-block offset (the block's minimum), in f32 so ``q * scale + offset`` gives the dequantized GGUF value to f32 rounding,
never a second 4- or 8-bit rounding:

=====  ===============================================  ======================================
type   block                                            kept as
=====  ===============================================  ======================================
Q8_0   32: f16 d, 32 x int8 q: w = q d                  i8 [rows, cols/32, 32] x d
Q4_0   32: f16 d, 16 B of nibbles: w = (q - 8) d        i4 (q - 8) x d
Q4_1   32: f16 d, f16 m, 16 B of nibbles: w = q d + m   u4 q x d, offset m
Q4_K   256: f16 d, dmin; 8 x 6-bit (sc, m); nibbles:    u4 q per 32 x d sc, offset -dmin m
       w = d sc q - dmin m
Q5_0   32: f16 d, 4 B of fifth bits, 16 B of nibbles:   i8 (q - 16) x d
       w = (q - 16) d
Q5_1   32: f16 d, f16 m, 4 B fifth bits, 16 B nibbles:  u8 q x d, offset m
       w = q d + m
Q5_K   256: Q4_K's fields + 32 B of high bits:          u8 q per 32 x d sc, offset -dmin m
       w = d sc q - dmin m
Q3_K   256: 2 + 1 bits q, 16 x 6-bit sc, f16 d:         i8 -(sc - 32) q per 32 x -d (exact: -128..124)
       w = d (sc - 32) q, q = -4..3, per 16
Q2_K   256: 16 x 4-bit (sc, m), 2-bit q, f16 d, dmin:   u8 sc q (0..45) per 32 x d, offset -dmin m per 16
       w = d sc q - dmin m, per 16
Q6_K   256: 4 + 2 bits q, 16 x int8 sc, f16 d:          i8 (q - 32) per 16, x d sc (exact)
       w = d sc (q - 32)
MXFP4  32: u8 e (E8M0), 16 B of E2M1 nibbles:           f4e2m1 codes x f8e8m0 e (the bytes as they
       w = E2M1(q) 2^(e - 127)                          are); experts, embedding: i8 2 E2M1 x 2^(e-128)
=====  ===============================================  ======================================

MXFP4: compiler/gguf_mxfp4.py.

GGUF stores element j of a block in the low nibble of byte j and element j + 16 in its high nibble;
OpenVINO's u4/i4 hold element 2k in the low nibble of byte k, 2k + 1 in the high one: repacked here.
Every other type (F16, BF16, IQ*, TQ*, NVFP4, ...) is dequantized by gguf-py (``gguf.quants``) and stored
as fp16 (``tensor``; a warning names the quantized ones); F32 tensors (norms, biases) stay f32.

Split files (llama.cpp's ``gguf-split``: ``<prefix>-00001-of-0000N.gguf``, ..., the name pattern of llama.h's
``llama_model_load_from_file``; the first part holds the metadata, every part ``split.no``, ``split.count`` and
``split.tensors.count``) are opened from the first part, every part memory-mapped (``open_reader``).

Mixture-of-Experts files (``qwen3moe``; Mixtral as ``llama`` with experts): compiler/gguf_moe.py.
"""

from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet_common.residency import release

from .arch import EMBEDDING
from . import gguf_gpt_oss as gpt_oss
from .gguf_families import ROPE_TENSORS, gemma3_config, phi3_rope
from .gguf_moe import ROUTER, expert_slices, is_expert_tensor, is_moe, moe_config, router_name
from .gguf_mxfp4 import MXFP4_I8, mxfp4_blocks
from .gguf_read import read_gguf_file
from .weights import WeightsError, check_f16_range, check_shapes

log = logging.getLogger(__name__)

GGUF_TO_HF = {  # llama.cpp tensor names -> HF names (llama.cpp gguf-py/gguf/tensor_mapping.py)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_TO_HF = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k, v fused; its ffn_up holds gate and up (source.split_fused)
}
GEMMA3_LAYER_TO_HF = {  # gemma3's four norms a layer (llama.cpp's Gemma3Model): its ffn_norm is the MLP's input norm
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "MXFP4")
GROUP = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q6_K": 16, "Q5_0": 32, "Q5_1": 32,
         "Q5_K": 32, "Q3_K": 32, "Q2_K": 32, "MXFP4": 32, "MXFP4/i8": 32}  # weights per scale
OFFSET_GROUP = {"Q2_K": 16}  # weights per offset where finer than per scale (``offset_group``)
STORED = {"Q8_0": "i8", "Q4_0": "i4", "Q4_1": "u4", "Q4_K": "u4", "Q6_K": "i8", "Q5_0": "i8",
          "Q5_1": "u8", "Q5_K": "u8", "Q3_K": "i8", "Q2_K": "u8", "MXFP4": "f4e2m1", "MXFP4/i8": "i8"}  # OpenVINO
WITH_OFFSET = ("Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K")  # w = q scale + offset per group (export.py: a zero point)
QK_K = 256  # weights per K-quant super-block (ggml-common.h)
# GGUF arch -> model_type (and llama with experts: mixtral, gguf_moe.py)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3_text",
                 "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
ROW_BLOCK_BYTES = 32 << 20
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp llama_split_path


def hf_name(name: str, model_type: str | None = None) -> str:
    """The HF name of GGUF tensor ``name`` (of a ``model_type`` file: gemma3's norms are named otherwise);
    ``WeightsError`` for one the builder does not know."""
    if name in GGUF_TO_HF:
        return GGUF_TO_HF[name]
    parts = name.split(".")
    if model_type == "gpt_oss" and (own := gpt_oss.gguf_name(parts)) is not None:
        return own
    layer_names = GGUF_LAYER_TO_HF | (GEMMA3_LAYER_TO_HF if model_type == "gemma3_text" else {})
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] == ROUTER and model_type in ("qwen3_moe", "mixtral"):
        return f"model.layers.{parts[1]}.{router_name(model_type)}.{parts[3]}"
    raise WeightsError(f"GGUF tensor {name!r} has no Hugging Face counterpart the builder knows")


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (which interleaves each head's two rotary halves): rows
    [heads, 2, D/2] back to HF's [heads, D/2, 2] order; trailing axes are carried along."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class QuantRows:
    """Rows of a kept quantized weight: ``values`` [rows, groups, GROUP[kind]] (int8 for Q8_0, Q6_K, Q5_0 and
    Q3_K, i4 values -8..7 as int8 for Q4_0, u4 values 0..15 as uint8 for Q4_1 and Q4_K, u5 values 0..31 as
    uint8 for Q5_1 and Q5_K, sc q 0..45 as uint8 for Q2_K, the doubled E2M1 values -12..12 as int8 for MXFP4),
    ``scale`` [rows, groups] f32 and ``offset`` [rows,
    cols / offset_group(kind)] f32 (``WITH_OFFSET``; else None; per group but Q2_K's, per 16): weight = values *
    scale + offset."""

    kind: str
    values: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    e2m1: np.ndarray | None = None  # MXFP4: the E2M1 codes, uint8 0..15 [rows, groups, 32] (values = 2 E2M1)
    e8m0: np.ndarray | None = None  # MXFP4: the scale bytes, uint8 [rows, groups] (scale = 2^(e8m0 - 128))

    def zero_point(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same weights as ``(values' - zero_point) * scale'`` (values', zero_point, scale', all per group of
        ``offset_group(kind)``: values' [rows, cols / og, og], the others [rows, cols / og]; zero_point = -offset /
        scale in f32, exact to f32 rounding): the one form OpenVINO's compressed Gather takes. A group of scale 0
        (every weight = offset) becomes values 0, scale 1, zero point -offset."""
        rows, k = self.values.shape[0], self.offset.shape[-1] // self.scale.shape[-1]  # k offsets per scale
        q = self.values.reshape(rows, self.offset.shape[-1], -1).copy()
        scale = np.repeat(self.scale, k, axis=-1)
        flat = scale == 0
        q[flat] = 0
        scale = np.where(flat, np.float32(1), scale).astype(np.float32)
        return q, (-self.offset / scale).astype(np.float32), scale


@dataclass(frozen=True)
class GGUFTensor:
    data: np.ndarray  # the reader's memory-mapped view: quantized [rows, bytes per row] uint8, or the values
    qtype: str
    shape: tuple[int, ...]  # HF order
    heads: int  # Q/K of a llama-family file: the heads its rows are permuted over; 0 = not permuted
    expert: bool = False  # one expert's slice of a stacked tensor (gguf_moe.py): blocks kept (KEPT) or fp16


class GGUFWeights:
    """The tensors of a GGUF file under HF names, read lazily (the interface of ``weights.SafetensorsWeights``
    plus ``kind``/``blocks`` for kept quantized blocks). ``config`` is the HF config dict built from the
    metadata (``gguf_config``)."""

    def __init__(self, path: Path, reader, config: dict) -> None:  # noqa: ANN001
        import gguf

        self.folder = Path(path)
        # the mapped files (a split GGUF's parts), whose pages read so far each read gives back to the kernel
        # (fleet_common/residency.py): the mapping lasts the build, and every page read stayed resident with it
        self._files = tuple(getattr(reader, "parts", None) or (path,))
        permuted = config["model_type"] in ("llama", "mixtral")
        self.tensors: dict[str, GGUFTensor] = {}
        skipped, experts, gpt_oss_experts = {}, {}, {}
        for t in reader.tensors:
            if t.name in ROPE_TENSORS:
                continue
            qtype = gguf.GGMLQuantizationType(t.tensor_type).name
            if config["model_type"] == "gpt_oss" and t.name.split(".")[2:3] in [[r] for r in gpt_oss.GGUF_EXPERTS]:
                gpt_oss_experts[t.name] = t  # gate and up interleaved back into HF's gate_up (compiler/gguf_gpt_oss.py)
                if qtype not in (*KEPT, "F32", "F16", "BF16"):
                    experts.setdefault(qtype, []).append(t.name)
                continue
            if config["model_type"] in ("qwen3_moe", "mixtral") and is_expert_tensor(t.name):
                shape = tuple(int(d) for d in reversed(t.shape))
                for name, data, rows_cols in expert_slices(t.name, t.data, shape, config["model_type"]):
                    self.tensors[name] = GGUFTensor(data, qtype, rows_cols, 0, expert=True)
                if qtype not in (*KEPT, "F32", "F16", "BF16"):  # blocks kept, or a stacked fp16 constant
                    experts.setdefault(qtype, []).append(t.name)
                continue
            name = hf_name(t.name, config["model_type"])
            heads = 0
            if permuted and name.endswith("q_proj.weight"):
                heads = config["num_attention_heads"]
            elif permuted and name.endswith("k_proj.weight"):
                heads = config["num_key_value_heads"]
            self.tensors[name] = GGUFTensor(t.data, qtype, tuple(int(d) for d in reversed(t.shape)), heads)
            if qtype not in (*KEPT, "F32", "F16", "BF16"):
                skipped.setdefault(qtype, []).append(name)
        if gpt_oss_experts:
            self.tensors |= gpt_oss.gguf_experts(gpt_oss_experts, config["num_hidden_layers"],
                                                 lambda data, qtype, shape, expert: GGUFTensor(data, qtype, shape, 0,
                                                                                               expert=expert))
        for qtype, names in skipped.items():
            log.warning("%s: %d %s tensor(s) (e.g. %s) are dequantized and stored as fp16: the builder keeps only "
                        "%s blocks as they are", self.folder.name, len(names), qtype, names[0], ", ".join(KEPT))
        for qtype, names in experts.items():
            log.warning("%s: %d stacked %s expert tensor(s) (e.g. %s) are dequantized and stored as fp16: the "
                        "builder keeps only %s blocks as they are", self.folder.name, len(names), qtype, names[0],
                        ", ".join(KEPT))

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape of tensor ``name`` (rows first)."""
        return self.tensors[name].shape

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> str:
        """How the builder stores ``name`` in OpenVINO's forms: a kept block type (``KEPT``), MXFP4's i8 form for the
        experts and the embedding (``MXFP4_I8``), ``"f32"`` or ``"f16"``."""
        qtype = self.tensors[name].qtype
        if self.tensors[name].expert and qtype not in KEPT:  # stacked experts: their blocks, or fp16
            return "f16"
        if qtype == "MXFP4" and (self.tensors[name].expert or name == EMBEDDING):  # folded as f4e2m1 there
            return MXFP4_I8
        return qtype if qtype in KEPT else "f32" if qtype == "F32" else "f16"

    def kernel_type(self, name: str) -> str | None:
        """The GGUF type fleet's kernels multiply ``name`` in (its type as stored, one of
        ``fleet_common.kernels.BLOCK_TYPES``), or None: a type they lack, not a matrix, or rows not lying in the
        file as one array (gpt-oss's ``gate_up``, gate and up rows interleaved from two tensors)."""
        from fleet_common.kernels import BLOCK_TYPES

        t = self.tensors[name]
        return t.qtype if t.qtype in BLOCK_TYPES and len(t.shape) == 2 and isinstance(t.data, np.ndarray) else None

    def block_bytes(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as they lie in the file, u8 [rows, row bytes] (rows in the file's order: see
        ``row_order``): a view of the memory map, read when used."""
        release(self._files)  # the previous read's pages
        t = self.tensors[name]
        data = np.asarray(t.data)
        return data.view(np.uint8).reshape(t.shape[0], -1)

    def row_bytes(self, name: str) -> int:
        """Bytes a row of matrix ``name`` takes in the file (``block_bytes``' width); nothing is read."""
        t = self.tensors[name]
        return np.asarray(t.data).nbytes // t.shape[0]

    def row_order(self, name: str) -> np.ndarray | None:
        """HF's rows of ``name`` as the file's rows (row i of HF's is row ``order[i]`` of the file: llama.cpp's
        Q/K permutation), or None where the file keeps HF's order."""
        t = self.tensors[name]
        return unpermute(np.arange(t.shape[0]), t.heads) if t.heads else None

    def check(self, expected: dict[str, tuple[int, ...]], where: str = "GGUF metadata") -> None:
        """Raise ``WeightsError`` unless every name in ``expected`` is here with that shape."""
        check_shapes(self.tensors, expected, self.folder, where)

    def _rows(self, t: GGUFTensor, rows: tuple[int, int] | None) -> np.ndarray:
        """The raw rows [start, stop) in HF order (the permutation undone by picking source rows)."""
        start, stop = rows if rows is not None else (0, t.shape[0])
        if not t.heads:
            return np.asarray(t.data[start:stop])
        order = unpermute(np.arange(t.shape[0]), t.heads)[start:stop]
        return np.asarray(t.data[order])

    def tensor(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``name`` (or rows ``[start, stop)``) dequantized by gguf-py, as float16 (float32 for
        ``kind == "f32"``), or into ``out`` (float16 or float32) when given. Raises ``WeightsError`` for
        values beyond fp16 when writing float16."""
        import gguf

        release(self._files)  # the previous read's pages (blocks returns views of them)
        t = self.tensors[name]
        shape = t.shape if rows is None else (rows[1] - rows[0], *t.shape[1:])
        if out is None:
            out = np.empty(shape, np.float32 if self.kind(name) == "f32" else np.float16)
        dtype = out.dtype.type
        row_bytes = max(1, int(np.prod(t.shape[1:], dtype=np.int64)) * 4)
        step = max(1, ROW_BLOCK_BYTES // row_bytes) if len(t.shape) > 1 else shape[0]
        first = 0 if rows is None else rows[0]
        for a in range(0, shape[0], step):
            b = min(shape[0], a + step)
            raw = self._rows(t, (first + a, first + b))
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.qtype]).reshape(b - a, *t.shape[1:])
            if dtype is np.float16:
                check_f16_range(values, self.folder.name, name)
            out[a:b] = values
        return out

    def blocks(self, name: str, rows: tuple[int, int]) -> QuantRows:
        """Rows ``[start, stop)`` of a kept quantized weight (``kind(name) in KEPT``), unpacked per block."""
        release(self._files)  # the previous read's pages (blocks returns views of them)
        t = self.tensors[name]
        raw = self._rows(t, rows)
        n = raw.shape[0]
        if t.qtype == "Q8_0":
            b = raw.reshape(n, -1, 34)
            return QuantRows("Q8_0", b[..., 2:].view(np.int8), _f16(b[..., :2]), None)
        if t.qtype == "Q4_0":
            b = raw.reshape(n, -1, 18)
            return QuantRows("Q4_0", _low_high(b[..., 2:]).astype(np.int8) - 8, _f16(b[..., :2]), None)
        if t.qtype == "Q4_1":
            b = raw.reshape(n, -1, 20)
            return QuantRows("Q4_1", _low_high(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]))
        if t.qtype == "Q5_0":
            b = raw.reshape(n, -1, 22)
            q = (_low_high(b[..., 6:]) | (_bits32(b[..., 2:6]) << 4)).astype(np.int8) - 16
            return QuantRows("Q5_0", q, _f16(b[..., 0:2]), None)
        if t.qtype == "Q5_1":
            b = raw.reshape(n, -1, 24)
            q = _low_high(b[..., 8:]) | (_bits32(b[..., 4:8]) << 4)
            return QuantRows("Q5_1", q, _f16(b[..., 0:2]), _f16(b[..., 2:4]))
        if t.qtype in ("Q4_K", "Q5_K"):  # gguf-py's Q4_K/Q5_K.dequantize_blocks, kept apart
            import gguf

            b = raw.reshape(n, -1, 144 if t.qtype == "Q4_K" else 176)
            blocks = b.shape[1]
            d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
            sc, mins = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
            scale = d[..., None] * sc.reshape(n, blocks, 8).astype(np.float32)  # [n, blocks, 8]
            minimum = dmin[..., None] * mins.reshape(n, blocks, 8).astype(np.float32)
            if t.qtype == "Q4_K":
                q = _planes(b[..., 16:], 4)
            else:  # Q5_K: 32 B of fifth bits (bit g of byte i: element i of group g), then Q4_K's nibbles
                q = _planes(b[..., 48:], 4) | (_planes(b[..., 16:48], 1) << 4)
            return QuantRows(t.qtype, q.reshape(n, blocks * 8, 32), scale.reshape(n, -1), -minimum.reshape(n, -1))
        if t.qtype == "Q3_K":  # gguf-py's Q3_K.dequantize_blocks, kept apart
            b = raw.reshape(n, -1, 110)
            blocks = b.shape[1]
            low = _planes(b[..., 32:96], 2).astype(np.int8)
            q = low - ((_planes(b[..., :32], 1) ^ 1) << 2).astype(np.int8)  # -4..3: 4 less where the mask bit is 0
            lo, hi = b[..., 96:104], b[..., 104:108]
            sc = (np.concatenate([lo & 0x0F, lo >> 4], axis=-1)  # 16 6-bit scales - 32, per 16 weights
                  | ((_planes(hi, 2, chunk=4) & 0x03) << 4)).astype(np.int8) - 32
            # d sc q = (-d) (-sc q), -sc q in -128..124: int8 per 32 with scale -d, exact (Q6_K's sc q is not)
            codes = (-(sc.reshape(n, blocks, 16, 1).astype(np.int16) * q.reshape(n, blocks, 16, 16))).astype(np.int8)
            scale = np.repeat(-_f16(b[..., 108:110]), 8, axis=-1)
            return QuantRows("Q3_K", codes.reshape(n, blocks * 8, 32), scale, None)
        if t.qtype == "Q2_K":  # gguf-py's Q2_K.dequantize_blocks, kept apart
            b = raw.reshape(n, -1, 84)
            blocks = b.shape[1]
            sc, mins = b[..., :16] & 0x0F, b[..., :16] >> 4  # per 16 weights
            # d sc q: sc q (0..45) times d, the super-block's one scale, so per 32 (the fast kernels) stays exact
            codes = sc[..., None] * _planes(b[..., 16:80], 2).reshape(n, blocks, 16, 16)
            d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
            offset = -(dmin[..., None] * mins.astype(np.float32)).reshape(n, -1)
            return QuantRows("Q2_K", codes.reshape(n, blocks * 8, 32), np.repeat(d, 8, axis=-1), offset)
        if t.qtype == "Q6_K":  # gguf-py's Q6_K.dequantize_blocks, kept apart
            b = raw.reshape(n, -1, 210)
            ql = _planes(b[..., :128], 4, chunk=64)
            qh = _planes(b[..., 128:192], 2)
            q = ((ql | (qh << 4)).astype(np.int8) - 32).reshape(n, -1, 16)
            scale = (_f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1)
            return QuantRows("Q6_K", q, scale, None)
        if t.qtype == "MXFP4":
            values, scale, codes, e = mxfp4_blocks(self.kind(name), raw.reshape(n, -1, 17), name)
            return QuantRows(self.kind(name), values, scale, None, e2m1=codes, e8m0=e)
        raise WeightsError(f"{name}: {t.qtype} blocks are not kept (only {', '.join(KEPT)})")



def offset_group(kind: str) -> int:
    """Weights per offset of an offset type (``WITH_OFFSET``): its scales' group but Q2_K's 16 (``OFFSET_GROUP``)."""
    return OFFSET_GROUP.get(kind, GROUP[kind])


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 fields: bytes uint8 [..., 2] -> f32 [...]."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """The low 4 bits of a 32-weight block (Q4_0/Q4_1/Q5_0/Q5_1): bytes uint8 [..., 16] -> [..., 32], element j
    in the low nibble of byte j, j + 16 in its high nibble (ggml-quants.c ``dequantize_row_q4_0``)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: a little-endian u32 as bytes uint8 [..., 4] -> 0/1 uint8 [..., 32], bit j of
    the u32 for element j (ggml-quants.c ``dequantize_row_q5_0``)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _planes(data: np.ndarray, width: int, chunk: int = 32) -> np.ndarray:
    """K-quant bit planes, as gguf-py's ``dequantize_blocks`` unpack them: bytes uint8 [..., k * chunk] ->
    uint8 [..., k * 8 / width * chunk], each run of ``chunk`` bytes giving ``8 / width`` runs of ``chunk``
    values, the lowest ``width`` bits first (Q4_K/Q5_K nibbles: width 4; Q6_K's high bits, Q3_K/Q2_K's
    2-bit values: width 2; Q5_K's and Q3_K's single bits: width 1)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    planes = data.reshape(*data.shape[:-1], -1, 1, chunk) >> shifts
    return (planes & np.uint8((1 << width) - 1)).reshape(*data.shape[:-1], -1)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values [..., 2n] (uint8 0..15, or int8 -8..7) -> bytes [..., n] in OpenVINO's u4/i4 layout
    (element 2k in the low nibble of byte k)."""
    v = values.astype(np.uint8) & 0x0F
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


@dataclass(frozen=True)
class SplitReader:
    """The parts of a split GGUF read as one file: the first part's metadata (``fields``), every part's
    tensors in order (``tensors``: gguf-py ``ReaderTensor`` views into each part's memory map), the parts'
    paths (``parts``). Has what the builder uses of a ``gguf.GGUFReader``."""

    fields: dict
    tensors: list
    parts: tuple[Path, ...]


def split_parts(path: Path, count: int) -> list[Path]:
    """The paths of a ``count``-part split GGUF whose first part is ``path``, named as llama.cpp names them
    (``llama_split_path``: ``<prefix>-%05d-of-%05d.gguf``, numbered from 1). ``ValueError`` when ``path`` is not
    named so, or is not the first part (naming the first)."""
    path = Path(path)
    match = SPLIT_NAME.match(path.name)
    if match is None or int(match["count"]) != count:
        raise ValueError(f"{path}: metadata split.count says {count} parts, but the file is not named "
                         f"<name>-00001-of-{count:05d}.gguf, so the other parts cannot be found")
    names = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if int(match["no"]) != 1:
        raise ValueError(f"{path} is part {int(match['no'])} of {count} of a split GGUF: give the first part, "
                         f"{names[0]}")
    return names


def _magic(path: Path) -> bytes:
    """The first 4 bytes of file ``path`` (a GGUF's magic); raises ``OSError``."""
    with open(path, "rb") as f:
        return f.read(4)


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic ``b"GGUF"`` (any name: Ollama's blobs have none)."""
    try:
        return _magic(path) == b"GGUF"
    except OSError:
        return False


POWERINFER_MAGIC = b"PWRI"  # PowerInfer's GGUF variant (its own ffn_down_t, fc1/fc2 predictors, sparse_threshold)


def _open_part(path: Path):  # noqa: ANN202 - a gguf.GGUFReader
    """gguf-py's memory-mapped reader of ``path``; ``ValueError`` naming the file when it is not a readable GGUF,
    and PowerInfer's files (magic ``PWRI``) by name: fleet does not read that variant."""
    try:
        magic = _magic(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if magic == POWERINFER_MAGIC:
        raise ValueError(f"{path} is a PowerInfer GGUF (magic PWRI, with its own ffn_down_t and fc1/fc2 neuron "
                         "predictors): fleet does not read PowerInfer's variant yet. Build the model's Hugging Face "
                         "folder with fleet-compiler build --sparse-ffn (docs/sparse-ffn.md)")
    try:
        return read_gguf_file(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from None


def field(reader, key: str, default: object = None) -> object:  # noqa: ANN001 - a GGUFReader or SplitReader
    """The decoded value of GGUF metadata ``key`` (gguf-py ``ReaderField.contents``), ``default`` if absent."""
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def _split_field(reader, key: str, path: Path, default: int | None = None) -> int:  # noqa: ANN001
    value = field(reader, key)
    if value is None and default is None:
        raise ValueError(f"{path}: metadata {key} missing (a part of a split GGUF has split.no, split.count and "
                         "split.tensors.count)")
    return default if value is None else int(value)


def open_reader(path: Path):  # noqa: ANN201 - a gguf.GGUFReader or a SplitReader
    """Open GGUF ``path`` memory-mapped: a ``gguf.GGUFReader``, or for the first part of a split file a
    ``SplitReader`` over all its parts (each memory-mapped; nothing is read but the headers).

    Raises ``ValueError`` naming the file for an unreadable, truncated or corrupt file or part, a part given
    that is not the first, parts that disagree on ``split.count``/``split.no`` or whose tensors do not add up
    to ``split.tensors.count``; ``FileNotFoundError`` naming every missing part."""
    path = Path(path)
    first = _open_part(path)
    count = _split_field(first, "split.count", path, default=1)
    if count <= 1:
        return first
    names = split_parts(path, count)
    missing = [str(p) for p in names[1:] if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is part 1 of a {count}-part split GGUF; missing part(s): "
                                f"{', '.join(missing)}")
    readers = [first] + [_open_part(p) for p in names[1:]]
    for number, (part, reader) in enumerate(zip(names, readers)):
        no, parts = _split_field(reader, "split.no", part), _split_field(reader, "split.count", part)
        if (no, parts) != (number, count):
            raise ValueError(f"{part}: metadata split.no {no}, split.count {parts}: not part {number + 1} of "
                             f"the {count} of {path.name}")
    tensors = [t for reader in readers for t in reader.tensors]
    total = _split_field(first, "split.tensors.count", path)
    names_seen = {t.name for t in tensors}
    if len(tensors) != total or len(names_seen) != total:
        raise ValueError(f"{path}: metadata split.tensors.count {total}, but the {count} parts hold "
                         f"{len(tensors)} tensors ({len(names_seen)} names)")
    return SplitReader(first.fields, tensors, tuple(names))


def gguf_config(reader, where: str) -> dict:  # noqa: ANN001
    """An HF ``config.json`` dict from a GGUF's metadata (llama.cpp's key names, gguf-py/gguf/constants.py
    ``Keys.LLM`` / ``Keys.Attention`` / ``Keys.Rope``). Raises ``UnsupportedModel``/``ValueError`` naming
    the file and the field."""
    from .arch import SUPPORTED_ARCHITECTURES, UnsupportedModel, refuse_gguf_architecture

    arch = field(reader, "general.architecture")
    moe = arch in ARCHITECTURES and is_moe(reader, arch)
    refuse_gguf_architecture(arch, where)
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"{where}: GGUF architecture {arch!r} is not supported; the builder makes "
                               f"{', '.join(ARCHITECTURES)} GGUF files ({', '.join(SUPPORTED_ARCHITECTURES)} from HF "
                               "folders)")

    def key(name: str, default: object = None) -> object:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{where}: metadata {arch}.{name} missing")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    names = {t.name for t in reader.tensors}
    scaling = field(reader, f"{arch}.rope.scaling.type")
    linear = arch == "gemma3" and scaling == "linear"  # Gemma 3 4B/12B/27B: the global layers' factor 8
    if scaling not in (None, "none") and not linear and not (arch == "gpt-oss" and scaling == "yarn"):
        raise UnsupportedModel(f"{where}: metadata {arch}.rope.scaling.type {scaling!r} is not supported (a GGUF's "
                               "RoPE is built as stored, with rope_freqs/LongRoPE factors, or gemma3's linear)")
    head_dim = int(key("attention.key_length", hidden // heads))  # llama.cpp's n_embd_head_k
    rope = {"rope_theta": float(key("rope.freq_base", 10000.0)), "rope_type": "default"}
    if linear:
        rope |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    if arch == "phi3":  # partial rotary (Phi-4-mini) and LongRoPE's factors (convert_hf_to_gguf Phi3MiniModel)
        rope |= phi3_rope(reader, arch, head_dim, where)
    for other in ("attention.value_length", "rope.dimension_count")[:1 if arch == "phi3" else 2]:  # default head_dim
        if int(key(other, head_dim)) != head_dim:
            raise UnsupportedModel(f"{where}: metadata {arch}.{other} {int(key(other))} differs from the head size "
                                   f"{head_dim} ({arch}.attention.key_length): partial rotary or other value heads "
                                   "are not supported")
    vocab = field(reader, "tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{where}: tensor token_embd.weight missing")
    config = {
        "architectures": [f"{arch.capitalize()}ForCausalLM"], "model_type": ARCHITECTURES[arch], "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", field(reader, f"{arch}.expert_feed_forward_length"))),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope, "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(embd.shape[1]) if vocab is None else len(vocab),
        "tie_word_embeddings": "output.weight" not in names, "attention_bias": arch == "qwen2", "mlp_bias": False,
        "has_rope_freqs": "rope_freqs.weight" in names,
    }
    if moe:
        config |= moe_config(reader, arch, config, where)
    if arch == "gpt-oss":  # its experts, YaRN and sliding layers (compiler/gguf_gpt_oss.py)
        return config | gpt_oss.gguf_config(reader, arch, config, where)
    window = field(reader, f"{arch}.attention.sliding_window")
    if arch == "gemma3":
        return config | gemma3_config(reader, config, rope, window)
    if window:  # exact while the context fits the window: arch.py serves no more than that
        config |= {"sliding_window": int(window), "use_sliding_window": True}
    return config


def rope_freqs(reader) -> np.ndarray | None:  # noqa: ANN001
    """Llama 3.1's per-frequency divisors (``rope_freqs.weight``, llama.cpp ``LlamaModel.generate_extra_tensors``)
    or None: inv_freq / rope_freqs is the scaled RoPE of the HF config's ``llama3`` rope_scaling."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else np.asarray(t.data, dtype=np.float64)
