"""Layer-range planning: which contiguous half-open ``[start, end)`` range each stage serves."""

from __future__ import annotations


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``num_stages`` contiguous ranges whose sizes differ by at most one
    (earlier stages get the extra layer). Raises ``ValueError`` if a stage would get no layer."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages (need 1..{num_layers})")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


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
