"""Issue 28 item 7, GGUF side: a file of an architecture with parts the builder does not make is refused naming
them (compiler/arch.py ``GGUF_NOT_BUILT``): Qwen3.5 / Qwen3-Next's gated delta net, Mamba and RWKV layers, an
mmproj file (a vision tower alone), a vision-language decoder's M-RoPE; and a RoPE scaling type it does not model
(yarn). The HF side of each (``vision_config``, ``layer_types`` with ``linear_attention``, ``rope_type`` yarn or
dynamic) is tests/unit/test_arch.py's and tests/integration/test_build_errors.py's. The files hold metadata and the
embedding only, written by gguf-py's ``GGUFWriter`` as llama.cpp's converter names them."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.arch import UnsupportedModel
from compiler.gguf import gguf_config, open_reader


def write(path, arch: str, rope_scaling: str | None = None) -> None:  # noqa: ANN001
    """A GGUF of ``general.architecture`` ``arch`` with a 64-wide, 4-head decoder's metadata and its embedding;
    ``rope_scaling``: ``{arch}.rope.scaling.type``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        writer.add_rope_scaling_factor(4.0)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "what"), [
    ("qwen35", r"linear-attention layers \(gated delta net, as Qwen3-Next/Qwen3\.5\)"),
    ("qwen35moe", r"gated delta net"),
    ("qwen3next", r"gated delta net"),
    ("mamba2", r"state-space \(Mamba\) layers"),
    ("jamba", r"state-space \(Mamba\) layers"),
    ("rwkv7", r"recurrent \(RWKV\) layers"),
    ("clip", r"only a vision or audio tower \(an mmproj file"),
    ("qwen2vl", r"multimodal RoPE \(M-RoPE\)"),
])
def test_an_architecture_with_parts_not_built_is_refused_naming_them(arch, what, tmp_path):
    """One ``UnsupportedModel`` naming the file, the architecture and the part, before any weight is read."""
    path = tmp_path / f"{arch}.gguf"
    write(path, arch)
    with pytest.raises(UnsupportedModel, match=f"^{path}: GGUF architecture '{arch}' has .*{what}.*, which the "
                                               "builder does not make: it builds text decoders of attention layers "
                                               "only$"):
        gguf_config(open_reader(path), str(path))


def test_an_unknown_architecture_lists_the_ones_built(tmp_path):
    """An architecture neither built nor in ``GGUF_NOT_BUILT`` (falcon) names itself and the list of those built."""
    path = tmp_path / "falcon.gguf"
    write(path, "falcon")
    with pytest.raises(UnsupportedModel, match=r"GGUF architecture 'falcon' is not supported; the builder makes "
                                               r"llama, qwen2, qwen3, phi3, gemma3, qwen3moe, gpt-oss GGUF files"):
        gguf_config(open_reader(path), str(path))


def test_a_rope_scaling_type_not_modelled_is_refused_by_name(tmp_path):
    """``llama.rope.scaling.type`` yarn (and linear outside gemma3): refused naming the key, the type and what is
    built; none (as llama.cpp's converter writes an unscaled model) reads as the default RoPE."""
    for scaling in ("yarn", "linear"):
        path = tmp_path / f"{scaling}.gguf"
        write(path, "llama", scaling)
        with pytest.raises(UnsupportedModel, match=rf"^{path}: metadata llama\.rope\.scaling\.type '{scaling}' is not "
                                                   r"supported \(a GGUF's RoPE is built as stored"):
            gguf_config(open_reader(path), str(path))
    path = tmp_path / "none.gguf"
    write(path, "llama", "none")
    assert gguf_config(open_reader(path), str(path))["rope_parameters"] == {"rope_theta": 10000.0,
                                                                           "rope_type": "default"}


def test_a_powerinfer_gguf_is_refused_by_name(tmp_path, capsys):
    """PowerInfer's variant (issue 47): its magic is PWRI, the rest a GGUF with ffn_down_t and fc1/fc2 predictors.
    fleet does not read it: the refusal names the variant and what to build instead, from the file and the CLI."""
    from compiler.cli import main as compiler_main

    plain = tmp_path / "plain.gguf"
    write(plain, "llama")
    pwri = tmp_path / "relu-llama.powerinfer.gguf"
    pwri.write_bytes(b"PWRI" + plain.read_bytes()[4:])
    with pytest.raises(ValueError, match="is a PowerInfer GGUF .magic PWRI"):
        open_reader(pwri)
    assert compiler_main(["build", str(pwri), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "PowerInfer GGUF" in err and "--sparse-ffn" in err
    assert not (tmp_path / "out").exists()
    open_reader(plain)  # the same bytes with GGUF's magic open
