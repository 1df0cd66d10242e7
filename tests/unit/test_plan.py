import pytest

from compiler.plan import balanced_split, decode_weights, parse_layers


def test_parse_layers():
    assert parse_layers("0:12,12:30", 30) == [(0, 12), (12, 30)]
    for bad, msg in [("0:12,13:30", "contiguous"), ("0:12,12:29", "30 layers"), ("0:0,0:30", "empty"),
                     ("a:b", "START:END"), ("1:30", "start at 0")]:
        with pytest.raises(ValueError, match=msg):
            parse_layers(bad, 30)


def test_balanced_split_counts_the_lm_head_on_the_last_stage():
    layer, head = decode_weights(576, 9, 3, 64, 1536, 49152)  # SmolLM2-135M
    assert head == 8 * layer
    assert balanced_split(30, 1, layer, head) == [(0, 30)]
    assert balanced_split(30, 2, layer, head) == [(0, 19), (19, 30)]  # 19 layers vs 11 + head
    split = balanced_split(30, 3, layer, head)
    costs = [(b - a) * layer + (head if i == 2 else 0) for i, (a, b) in enumerate(split)]
    assert split[0][0] == 0 and split[-1][1] == 30 and max(costs) == 13 * layer  # optimum: ceil(38 / 3)
    assert balanced_split(30, 2, 1, 0) == [(0, 15), (15, 30)]  # no head: an even split
    assert balanced_split(4, 3, 1, 100) == [(0, 2), (2, 3), (3, 4)]  # every stage keeps a layer
    with pytest.raises(ValueError):
        balanced_split(2, 3, 1, 0)
