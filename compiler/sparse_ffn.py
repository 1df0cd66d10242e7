"""The sparse FFN in a stage's graph (issue 47): a ReLU-family model's dense MLP as fleet's ``GgufSparseFfn``, which
computes ``gate`` for every neuron, ``up`` and the transposed down projection (compiler/down_t.py) only for the
neurons whose gate fired. With ReLU masks (threshold 0) it is the dense MLP's arithmetic on exactly the neurons
that are not zero: the same function, summed in another order (kernels/core/sparse.h)."""

from __future__ import annotations

from dataclasses import dataclass, field

import openvino as ov

from fleet_common import kernels

from .layers import GgufWeight

ACTIVATIONS = ("relu", "silu")  # relu: exact masks; silu (SwiGLU): thresholds calibrated (compiler/calibrate.py)


class SparseFfnError(ValueError):
    """A build that asks for the sparse FFN where it cannot be had, with what would make it possible."""


@dataclass(frozen=True)
class SparseFfn:
    """How a build's MLPs skip neurons: exact ReLU masks (no thresholds), or a SwiGLU model's per-layer thresholds on
    |silu(gate)| (compiler/calibrate.py)."""

    thresholds: dict[int, float] = field(default_factory=dict)  # layer -> t; empty: ReLU, t = 0

    def threshold(self, layer: int) -> float:
        """Layer ``layer``'s threshold (0 for exact ReLU masks); ``KeyError`` for a layer never calibrated."""
        return self.thresholds[layer] if self.thresholds else 0.0


def check_sparse_ffn(mlp_act: str, kernels_everywhere: bool, sparsity: float | None = None) -> None:
    """Refuse ``--sparse-ffn [S]`` (``SparseFfnError``, one line saying why) where it cannot be had: a ReLU model
    given a sparsity (its masks are exact: what fires is computed), a SwiGLU model without one (its neurons are
    rarely exactly zero: which to skip is calibrated for a sparsity S), another activation (Gemma's GeGLU), a
    sparsity outside (0, 1), or a stage that does not run on fleet's kernels (a GPU/NPU stage, ``--weights
    int8/int4``)."""
    if mlp_act not in ACTIVATIONS:
        raise SparseFfnError(f"--sparse-ffn: this model's MLP activation is {mlp_act}; the sparse FFN runs ReLU-family "
                             "models (hidden_act relu: ReluLLaMA, ProSparse, MiniCPM-S; exact) and SwiGLU ones (silu, "
                             "calibrated: --sparse-ffn S)")
    if mlp_act == "relu" and sparsity is not None:
        raise SparseFfnError(f"--sparse-ffn {sparsity}: this model's ReLU masks are exact (what fires is computed, "
                             "whatever fraction that is): give --sparse-ffn without a value")
    if mlp_act == "silu" and sparsity is None:
        raise SparseFfnError("--sparse-ffn: this is a SwiGLU model, whose neurons are rarely exactly zero: give the "
                             "fraction of each layer's neurons to skip, e.g. --sparse-ffn 0.3 (thresholds calibrated "
                             "on a text, the loss measured against the dense build: docs/sparse-ffn.md)")
    if sparsity is not None and not 0.0 < sparsity < 1.0:
        raise SparseFfnError(f"--sparse-ffn {sparsity}: give the fraction of each layer's neurons to skip, "
                             "between 0 and 1 (e.g. 0.3)")
    if not kernels_everywhere:
        raise SparseFfnError("--sparse-ffn: every stage must run on fleet's kernels (CPU stages of a GGUF's own "
                             "blocks or of an HF folder's fp16 weights: no --weights int8/int4, no GPU/NPU stage)")


def sparse_mlp(x: ov.Output, w: dict, down_t: GgufWeight, act: str, threshold: float = 0.0) -> ov.Output:
    """``down(act(gate(x)) * up(x))`` for x [B, S, H] -> [B, S, H] as one ``GgufSparseFfn``: ``w["gate"]`` and
    ``w["up"]`` the stage's ``GgufWeight`` blocks, ``down_t`` the transposed down projection; a neuron is computed
    where |act(gate)| > ``threshold`` (relu, 0: exactly the dense MLP's nonzero neurons)."""
    gate, up = w["gate"], w["up"]
    if not (isinstance(gate, GgufWeight) and isinstance(up, GgufWeight)) or gate.order is not None:
        raise SparseFfnError("--sparse-ffn: the MLP's gate and up must be kernel blocks in HF's row order")
    return kernels.gguf_sparse_ffn(x, gate.blocks, up.blocks, down_t.blocks, gate.block_type, up.block_type,
                                   down_t.block_type, activation=act, threshold=threshold)
