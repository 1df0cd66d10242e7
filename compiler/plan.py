"""Layer-range planning: which contiguous half-open ``[start, end)`` range each stage serves."""

from __future__ import annotations


def decode_weights(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                   vocab: int) -> tuple[int, int]:
    """(weights one decoder layer reads per decoded token, weights the LM head reads), in parameters.

    Decode on these PCs is bound by weight reads, so this is the cost model of a stage: attention
    projections (q, k, v, o) plus the gated MLP (3 matrices) per layer; the head is vocab x hidden
    (the embedding lookup on stage 0 reads one row, ~free)."""
    layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * intermediate
    return layer, vocab * hidden


def balanced_split(num_layers: int, num_stages: int, layer_cost: float, head_cost: float) -> list[tuple[int, int]]:
    """Contiguous ranges minimizing the costliest stage, where a stage costs ``layer_cost`` per layer
    and the last one also ``head_cost`` (the LM head: 8 layers' worth for SmolLM2-135M, so an even
    split leaves the last stage ~1.5x the first and caps a pipeline's throughput there). Exact for
    this cost model: tries every bottleneck in whole layers, filling stages greedily from the back.
    Raises ``ValueError`` if a stage would get no layer."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (need 1..{num_layers})")
    best = None
    for limit in range(1, num_layers + 1):
        ranges, end = [], num_layers
        for stage in reversed(range(num_stages)):
            budget = limit * layer_cost - (head_cost if stage == num_stages - 1 else 0)
            room = max(1, int(budget // layer_cost + 1e-9)) if budget >= layer_cost else 1
            start = max(stage, end - room)  # leave one layer for each earlier stage
            if stage == 0:
                start = 0
            ranges.append((start, end))
            end = start
        ranges.reverse()
        cost = max((b - a) * layer_cost + (head_cost if i == num_stages - 1 else 0) for i, (a, b) in enumerate(ranges))
        if best is None or cost < best[0] - 1e-9:
            best = (cost, ranges)
    return best[1]


def parse_layers(spec: str, num_layers: int) -> list[tuple[int, int]]:
    """Parse ``"0:12,12:30"`` into ``[(0, 12), (12, 30)]`` and check the ranges tile ``[0, num_layers)``.

    Raises ``ValueError`` naming the first problem (syntax, gap, overlap, empty range, wrong end).
    """
    ranges = []
    for part in spec.split(","):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"bad layer range {part!r}: expected START:END, e.g. 0:12,12:30") from None
        ranges.append((a, b))
    expected_start = 0
    for a, b in ranges:
        if a != expected_start:
            raise ValueError(f"layer range {a}:{b} should start at {expected_start} (ranges must be contiguous)")
        if b <= a:
            raise ValueError(f"layer range {a}:{b} is empty")
        expected_start = b
    if expected_start != num_layers:
        raise ValueError(f"layer ranges end at {expected_start} but the model has {num_layers} layers")
    return ranges
