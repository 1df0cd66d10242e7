"""``fleet-compiler build --sparse-ffn`` (issue 47): a ReLU-family model's MLPs as fleet's ``GgufSparseFfn`` (gate for
every neuron, up and the transposed down projection only for the neurons whose gate fired) compute what the dense
build and transformers compute: logits through the chained stages (the STEPS of test_architectures: prefill,
chunks, hidden rejected slots) within test_architectures' ATOL of transformers' f32, the same argmax, and greedy
through a real 2-stage fleet id for id. A random ReLU model's gates are ~50% negative, so about half of every
token's neurons are skipped here. What cannot be built sparse is refused by name, before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from fleet_common.manifest import load_manifest
from tests.conftest import Fleet, chat
from tests.integration.gguf_bytes import kernel_constants
from tests.integration.test_architectures import ATOL, PROMPT, Zoo, chained_logits, hf_greedy

pytestmark = pytest.mark.integration

ARCH = "llama_relu"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, demo_hf) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("sparse-ffn"), demo_hf)


@pytest.fixture(scope="module")
def sparse_build(zoo):  # noqa: ANN201
    from compiler.build import build

    out = zoo.root / "builds" / "sparse-2"
    build(zoo.sources(ARCH)["bf16"], out, shards=2, sparse_ffn=True)
    return out


def test_every_mlp_is_one_sparse_op_over_the_transposed_down_projection(sparse_build, zoo):
    layers = 0
    for stage in load_manifest(sparse_build).manifest.stages:
        xml = (sparse_build / stage.xml).read_text()
        layers += stage.num_layers
        assert xml.count('type="GgufSparseFfn"') == stage.num_layers, stage
        assert "down_proj.weight/matmul" not in xml  # the dense down product is gone, not kept beside it
        assert stage.kernels is not None
    assert layers == 4
    products = kernel_constants(sparse_build / "stage_0/openvino_model.xml")  # the remaining GgufMatMul weights
    assert not any("down_proj" in name for name in products)


def test_sparse_logits_match_transformers_and_the_dense_build(sparse_build, zoo):
    expected = zoo.reference_logits(ARCH, "bf16")
    got = chained_logits(sparse_build, zoo.ids, zoo.garbage)
    dense = chained_logits(zoo.build(ARCH, "bf16", 2), zoo.ids, zoo.garbage)
    assert np.abs(got - expected).max() < ATOL, f"max |error| {np.abs(got - expected).max():.3g}"
    assert np.abs(got - dense).max() < ATOL  # the same function, summed in another order
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_a_fleet_of_the_sparse_build_answers_transformers_greedy(sparse_build, zoo, tmp_path):
    from coordinator.tokenizer import ChatTokenizer

    prompt = ChatTokenizer(sparse_build).encode_chat([{"role": "user", "content": PROMPT}])
    expected = hf_greedy(zoo.reference(ARCH, "bf16"), prompt, 24)
    fleet = Fleet(sparse_build, tmp_path, peers=True)
    try:
        r = chat(fleet.url, PROMPT, max_tokens=24, ignore_eos=True)
    finally:
        fleet.stop()
    assert r.status_code == 200, r.text
    assert r.json()["fleet"]["completion_token_ids"] == expected


def test_what_cannot_be_sparse_is_refused_by_name(zoo, tmp_path):
    from compiler.build import build
    from compiler.sparse_ffn import SparseFfnError

    with pytest.raises(SparseFfnError, match="a SwiGLU model, whose neurons are rarely exactly zero: give the fraction"):
        build(zoo.sources("llama")["bf16"], tmp_path / "silu", shards=1, sparse_ffn=True)
    with pytest.raises(SparseFfnError, match="ReLU masks are exact"):
        build(zoo.sources(ARCH)["bf16"], tmp_path / "silu", shards=1, ffn_sparsity=0.5)
    for bad in (0.0, 1.0):
        with pytest.raises(SparseFfnError, match="between 0 and 1"):
            build(zoo.sources("llama")["bf16"], tmp_path / "silu", shards=1, ffn_sparsity=bad)
    with pytest.raises(SparseFfnError, match="every stage must run on fleet's kernels"):
        build(zoo.sources(ARCH)["bf16"], tmp_path / "int8", shards=1, weights="int8", sparse_ffn=True)
    assert not (tmp_path / "silu").exists() and not (tmp_path / "int8").exists()
