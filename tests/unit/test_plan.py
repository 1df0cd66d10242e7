import pytest

from compiler.plan import even_split, parse_layers


def test_even_split():
    assert even_split(30, 2) == [(0, 15), (15, 30)]
    assert even_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert even_split(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        even_split(2, 3)


def test_parse_layers():
    assert parse_layers("0:12,12:30", 30) == [(0, 12), (12, 30)]
    for bad, msg in [("0:12,13:30", "contiguous"), ("0:12,12:29", "30 layers"), ("0:0,0:30", "empty"),
                     ("a:b", "START:END"), ("1:30", "start at 0")]:
        with pytest.raises(ValueError, match=msg):
            parse_layers(bad, 30)
