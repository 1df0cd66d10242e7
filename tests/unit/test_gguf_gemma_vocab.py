"""Gemma's SentencePiece GGUF vocabulary (compiler/gguf_tokenizer.py) against transformers' GemmaTokenizer.

A tiny SentencePiece BPE model is trained here with Gemma's settings (byte fallback, no dummy prefix, whitespace
kept, digits split; pad/eos/bos/unk at ids 0-3 as Gemma's; ``<start_of_turn>``/``<end_of_turn>`` user-defined
pieces, plus ``\\n\\n`` and ``▁▁▁`` as Gemma's whitespace pieces), in an HF folder as Gemma 3's (tokenizer.model,
tokenizer_config.json whose ``added_tokens_decoder`` marks the specials and the turn markers special and the
whitespace pieces not), and written to a GGUF as llama.cpp's converter writes a Gemma 3 file
(``Gemma3Model.set_vocab``: ``_set_vocab_sentencepiece``, whose ``_create_vocab_sentencepiece`` makes the
added_tokens_decoder entries CONTROL or USER_DEFINED with their ``▁`` turned into spaces and score -1000, then
``add_space_prefix`` false; bos/eos/add_bos_token through gguf-py's SpecialVocab). fleet's tokenizer rebuilt
from that file must give transformers' ids (``AutoTokenizer`` of the folder: GemmaTokenizer converted from
tokenizer.model) and sentencepiece's own (which reads special-token text as text, so texts with one are left
out there), BOS included as llama.cpp adds it, and decode back to the text.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from compiler.gguf_read import read_gguf_file
from compiler.gguf_tokenizer import read_tokenizer
from compiler.source import write_gguf_tokenizer
from coordinator.errors import InvalidRequest
from coordinator.tokenizer import ChatTokenizer

from .test_gguf_tokenizer import CORPUS, TEXTS, fuzz_texts

SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<start_of_turn>", 5: "<end_of_turn>"}
PLAIN = {6: "\n\n", 7: "\u2581\u2581\u2581"}  # Gemma's whitespace pieces: user-defined, not special
BOS = 2
CHAT = [
    "<start_of_turn>user\nHi  there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nWrite 12345 in words.<end_of_turn>\n<start_of_turn>model\ntwelve<end_of_turn>",
    "<end_of_turn><end_of_turn>x<start_of_turn>",
    "a\n\nb   c    d\n\n\n",
]
EXTRA = [" leading space", "trailing space ", "   three", "x\u2581y", "tab\tnew\nline\r\n", "\u00ff\u0100 bytes \x00\x7f"]


def _entry(content: str, special: bool) -> dict:
    return {"content": content, "lstrip": False, "normalized": not special, "rstrip": False, "single_word": False,
            "special": special}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """The HF folder of the tiny Gemma-style SentencePiece model (module docstring)."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("gemma-spm")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=700, byte_fallback=True,
        add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=[SPECIALS[4], SPECIALS[5], *PLAIN.values()], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", hard_vocab_limit=False,
        minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    decoder = {str(i): _entry(t, True) for i, t in SPECIALS.items()} | {str(i): _entry(t, False)
                                                                         for i, t in PLAIN.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "added_tokens_decoder": decoder}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}))
    return folder


def gemma_gguf(folder: Path, path: Path, template: str | None = None) -> Path:
    """A tensor-less gemma3 GGUF with the vocabulary as convert_hf_to_gguf.py writes Gemma 3's (module docstring)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = next((gguf.TokenType[name] for check, name in ((sp.IsUnknown, "UNKNOWN"), (sp.IsControl, "CONTROL"),
                                                              (sp.IsUnused, "UNUSED"), (sp.IsByte, "BYTE"))
                     if check(i)), gguf.TokenType.NORMAL)
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(kind)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, entry in config["added_tokens_decoder"].items():
        i, text = int(key), entry["content"]
        types[i] = gguf.TokenType.CONTROL if entry["special"] else gguf.TokenType.USER_DEFINED
        tokens[i] = text if entry["special"] else text.replace("\u2581", " ")
        scores[i] = -1000.0
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(512)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fleet_files(gguf_path: Path, out: Path) -> Path:
    """The tokenizer files and generation_config.json a build writes for the GGUF (compiler/source.py)."""
    meta = read_tokenizer(read_gguf_file(str(gguf_path)), gguf_path)
    write_gguf_tokenizer(meta, {}, out)
    return out


def test_gemma_sentencepiece_gguf_tokenizer_equals_transformers_and_sentencepiece(gemma_dir, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    path = gemma_gguf(gemma_dir, tmp_path / "gemma.gguf")
    meta = read_tokenizer(read_gguf_file(str(path)), path)
    assert (meta["add_bos"], meta["add_space_prefix"], meta["bos_id"], meta["eos_id"]) == (True, False, BOS, 1)
    ours = Tokenizer.from_file(str(fleet_files(path, tmp_path / "fleet") / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(gemma_dir)
    sp = spm.SentencePieceProcessor(model_file=str(gemma_dir / "tokenizer.model"))
    assert type(hf).__name__ == "GemmaTokenizer" and hf.bos_token_id == BOS
    fallback = 0
    for text in TEXTS + EXTRA + CHAT + fuzz_texts():
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text).ids == hf.encode(text) == [BOS, *ids], text  # BOS as llama.cpp adds it
        if "<" not in text:  # sentencepiece reads the markers as text
            assert ids == sp.encode(text), text
            assert ours.decode(ids) == sp.decode(ids) == text.replace("\u2581", " "), text  # no prefix stripped
        fallback += sum(ours.id_to_token(i).startswith("<0x") for i in ids)
    assert fallback > 20  # CJK, emoji and control bytes went through the byte fallback
    turn = ours.encode("<start_of_turn>model\n", add_special_tokens=False).ids
    assert turn[0] == 4 and ours.encode("b   c", add_special_tokens=False).ids[1] == 7  # markers and "   " whole


def test_gemma_gguf_without_template_gets_the_builtin_gemma_turns(gemma_dir, tmp_path, caplog):
    """No tokenizer.chat_template: the build picks the gemma format from the turn markers, logs and records it;
    the prompt is llama.cpp's gemma format (the system text opens the first user turn) after BOS."""
    with caplog.at_level(logging.INFO, logger="compiler.gguf_tokenizer"):
        out = fleet_files(gemma_gguf(gemma_dir, tmp_path / "gemma.gguf"), tmp_path / "fleet")
    assert "built-in 'gemma' chat template" in caplog.text
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 5]  # <end_of_turn> too
    assert json.loads((out / "tokenizer_config.json").read_text())["fleet_chat_template"] == "builtin:gemma"
    chat = ChatTokenizer(out)
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Again"}]
    text = chat.render_chat(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n")
    ids = chat.encode(text)
    assert ids[:2] == [BOS, 4] and ids.count(4) == 4 and ids.count(5) == 3 and ids.count(BOS) == 1


def test_gguf_with_its_own_template_keeps_it_and_one_with_no_known_format_refuses_chat(gemma_dir, tmp_path):
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = fleet_files(gemma_gguf(gemma_dir, tmp_path / "own.gguf", own), tmp_path / "own")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["chat_template"], config["fleet_chat_template"]) == (own, "gguf")
    plain = tmp_path / "plain"  # the same vocabulary without turn markers: no format to pick
    plain.mkdir()
    for name in ("tokenizer.model", "config.json"):
        (plain / name).write_bytes((gemma_dir / name).read_bytes())
    config = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    for key in ("4", "5"):
        config["added_tokens_decoder"][key] |= {"content": f"<unused{key}>"}
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    out = fleet_files(gemma_gguf(plain, tmp_path / "plain.gguf"), tmp_path / "plain-out")
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    chat = ChatTokenizer(out)
    with pytest.raises(InvalidRequest, match="no chat template.*/v1/completions"):
        chat.render_chat([{"role": "user", "content": "Hi"}])
    assert chat.encode("Hi there")  # completions still tokenize
