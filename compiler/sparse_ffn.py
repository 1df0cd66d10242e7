"""The sparse FFN in a stage's graph (issue 47): a ReLU-family model's dense MLP as fleet's ``GgufSparseFfn``, which
computes ``gate`` for every neuron, ``up`` and the transposed down projection (compiler/down_t.py) only for the
neurons whose gate fired. With ReLU masks (threshold 0) it is the dense MLP's arithmetic on exactly the neurons
that are not zero: the same function, summed in another order (kernels/core/sparse.h)."""

from __future__ import annotations

import openvino as ov

from fleet_common import kernels

from .layers import GgufWeight

ACTIVATIONS = ("relu",)  # exact masks; SwiGLU's calibrated thresholds are not built yet


class SparseFfnError(ValueError):
    """A build that asks for the sparse FFN where it cannot be had, with what would make it possible."""


def check_sparse_ffn(mlp_act: str, kernels_everywhere: bool) -> None:
    """Refuse ``--sparse-ffn`` (``SparseFfnError``, one line saying why) for a model whose MLP is not a ReLU
    family's (SwiGLU's neurons are rarely exactly zero: its thresholds need a calibration fleet does not do yet)
    or for a stage that does not run on fleet's kernels (a GPU/NPU stage, ``--weights int8/int4``)."""
    if mlp_act not in ACTIVATIONS:
        raise SparseFfnError(f"--sparse-ffn: this model's MLP activation is {mlp_act}; the sparse FFN is exact for "
                             f"ReLU-family models (hidden_act relu: ReluLLaMA, ProSparse, MiniCPM-S) and fleet does "
                             "not calibrate thresholds for SwiGLU models yet")
    if not kernels_everywhere:
        raise SparseFfnError("--sparse-ffn: every stage must run on fleet's kernels (CPU stages of a GGUF's own "
                             "blocks or of an HF folder's fp16 weights: no --weights int8/int4, no GPU/NPU stage)")


def sparse_mlp(x: ov.Output, w: dict, down_t: GgufWeight, act: str) -> ov.Output:
    """``down(act(gate(x)) * up(x))`` for x [B, S, H] -> [B, S, H] as one ``GgufSparseFfn``: ``w["gate"]`` and
    ``w["up"]`` the stage's ``GgufWeight`` blocks, ``down_t`` the transposed down projection. Exact masks only
    (``act`` relu, threshold 0)."""
    gate, up = w["gate"], w["up"]
    if not (isinstance(gate, GgufWeight) and isinstance(up, GgufWeight)) or gate.order is not None:
        raise SparseFfnError("--sparse-ffn: the MLP's gate and up must be kernel blocks in HF's row order")
    return kernels.gguf_sparse_ffn(x, gate.blocks, up.blocks, down_t.blocks, gate.block_type, up.block_type,
                                   down_t.block_type, activation=act, threshold=0.0)
