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


def balanced_split(num_layers: int, num_stages: int, layer_cost: float, head_cost: float,
                   speeds: list[float] | None = None, max_layers: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous ranges minimizing the slowest stage, where stage ``i`` takes ``(layers * layer_cost +
    head_cost [last stage only]) / speeds[i]`` per token (the LM head: 8 layers' worth for SmolLM2-135M,
    so an even split leaves the last stage ~1.5x the first and caps a pipeline's throughput there).

    ``speeds``: relative speed of each stage's node (default all 1); ``max_layers``: the most layers each
    stage may hold (its memory; default no limit). Exact for this cost model: the bottleneck is the
    smallest of the stages' possible costs for which filling the stages from the back, each with as
    many layers as it and its ``max_layers`` allow, leaves stage 0 within both (giving a later stage
    more layers never hurts an earlier one). Among splits with that bottleneck, the later stages take
    as few layers as the smallest fill limit allows (for equal speeds: the split of filling from the
    back in whole layers' worth, which this function has always returned).
    Raises ``ValueError`` if a stage would get no layer, or when ``max_layers`` cannot hold them all."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (need 1..{num_layers})")
    speeds = [1.0] * num_stages if speeds is None else list(speeds)
    caps = [num_layers] * num_stages if max_layers is None else [min(c, num_layers) for c in max_layers]
    if len(speeds) != num_stages or len(caps) != num_stages:
        raise ValueError(f"need one speed and one layer limit per stage ({num_stages})")
    if min(speeds) <= 0:
        raise ValueError(f"speeds must be positive, got {speeds}")
    last = num_stages - 1

    def cost(stage: int, layers: int) -> float:
        return (layers * layer_cost + (head_cost if stage == last else 0)) / speeds[stage]

    def room(stage: int, limit: float) -> int:
        """The most layers ``stage`` can take within ``limit`` (no cap)."""
        budget = limit * speeds[stage] - (head_cost if stage == last else 0)
        return max(0, int(budget / layer_cost + 1e-9)) if layer_cost > 0 else num_layers

    def fill(limit: float, bottleneck: float) -> list[tuple[int, int]] | None:
        """Stages 1.. from the back, each taking what ``limit`` allows but at least one layer (within
        ``bottleneck``), stage 0 the rest; None unless every stage stays within ``bottleneck`` and its cap."""
        ranges, end = [], num_layers
        for stage in range(last, 0, -1):
            take = min(max(1, room(stage, limit)), caps[stage], end - stage)  # leave a layer per earlier stage
            if take < 1 or cost(stage, take) > bottleneck * (1 + 1e-9):
                return None
            ranges.append((end - take, end))
            end -= take
        if end > caps[0] or cost(0, end) > bottleneck * (1 + 1e-9):
            return None
        return [(0, end), *ranges[::-1]]

    def smallest(candidates: list[float], ok) -> float | None:  # noqa: ANN001 - ok(limit) is monotone
        lo, hi = 0, len(candidates)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(candidates[mid]) else (mid + 1, hi)
        return candidates[lo] if lo < len(candidates) else None

    costs = sorted({cost(s, k) for s in range(num_stages) for k in range(1, caps[s] + 1)})
    bottleneck = smallest(costs, lambda t: fill(t, t) is not None)
    if bottleneck is None:
        raise ValueError(f"stages holding at most {caps} layers cannot hold {num_layers} layers")
    fills = sorted({cost(s, k) for s in range(last) for k in range(1, caps[s] + 1)} | {bottleneck})
    limit = smallest([t for t in fills if t <= bottleneck], lambda t: fill(t, bottleneck) is not None)
    return fill(limit, bottleneck)


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
