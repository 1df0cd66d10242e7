"""bench/pipeline/grammar_bench.py: the larger vocabulary it builds from the demo's tokenizer (its size, the demo's tokens
kept, new tokens unique concatenations, the same for the same seed, loadable by llguidance) and one schema's
walk on it with llguidance alone (the path is valid and ends the grammar, every position timed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.pipeline import grammar_bench as gb

SIZE = 49_152 + 2_000


@pytest.fixture(scope="module")
def demo() -> str:
    if not gb.DEMO_TOKENIZER.exists():
        pytest.skip("the demo model is not fetched (tests/conftest.py's build fixtures fetch it)")
    return gb.demo_tokenizer_json()


@pytest.fixture(scope="module")
def grown(demo: str) -> str:
    return gb.extend_vocabulary(demo, SIZE, seed=3)


@pytest.fixture(scope="module")
def lib(grown: str) -> gb.Llguidance:
    return gb.Llguidance(grown, SIZE)  # llguidance reads it as a tokenizer like any other


def test_the_larger_vocabulary_grows_the_demo_one(demo: str, grown: str, lib: gb.Llguidance) -> None:
    old, new = json.loads(demo)["model"]["vocab"], json.loads(grown)["model"]["vocab"]
    assert len(new) == SIZE and sorted(new.values()) == list(range(SIZE))
    assert all(new[piece] == i for piece, i in old.items())
    pieces = set(old) - {token["content"] for token in json.loads(demo)["added_tokens"]}
    added = [piece for piece, i in new.items() if i >= len(old)]
    assert all(any(p[:j] in pieces and p[j:] in pieces for j in range(1, len(p))) for p in added[:200])
    assert gb.extend_vocabulary(demo, SIZE, seed=3) == grown  # deterministic
    with pytest.raises(ValueError, match="already has 49152 tokens"):
        gb.extend_vocabulary(demo, 1000)
    assert lib.grammars.tokenizer().vocab_size == SIZE


def test_one_schema_walked_with_llguidance(lib: gb.Llguidance) -> None:
    name, schema = next(s for s in gb.grammars_under_test() if s[0] == "person")
    grammar = lib.compile(schema)
    path = gb.random_path(lib, grammar, 64, np.random.default_rng(0))
    matcher = lib.matcher(grammar)
    for token in path:
        matcher.consume(token)
    assert matcher.stopped and len(path) >= 8  # {"name":"…","age":N} to its end
    walked = gb.walk(lib, grammar, path, 2, gb.mask_words(SIZE))
    assert len(walked.mask_us) == len(path) + 1 and len(walked.advance_us) == len(path) and walked.refused is None
    assert all(t > 0 for t in walked.mask_us) and gb.allowed_ids(walked.masks[-1], SIZE).tolist() == [gb.EOS]
    times = gb.compile_times(lib, [(name, schema)], 1)
    assert times["first_ms"][name] > 0 and times["again_ms"][name] > 0
    assert gb.valid_prefix(lib, grammar, [*path, gb.EOS, 5], 64) == path
