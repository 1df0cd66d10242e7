"""GGUF tokenizers (compiler/gguf_tokenizer.py) against HF tokenizers of the same vocabulary.

For each byte-level BPE pre-tokenizer a small vocabulary is trained here with the ``tokenizers`` library in
the pre-tokenizer layout of that family's own HF tokenizer (transformers' ``Qwen2Tokenizer`` and
``GPT2Tokenizer`` build theirs; Llama 3's is transformers' ``TikTokenConverter`` layout with its regex,
SmolLM2's is Digits + ByteLevel), written to a GGUF as llama.cpp's ``convert_hf_to_gguf.py`` writes one
(tokens, token types, pre name; merges and special ids through gguf-py's ``SpecialVocab``), rebuilt by fleet
from the GGUF and compared id for id with the HF tokenizer, and decoded back to the exact text.
SentencePiece: a model trained with the ``sentencepiece`` library is the reference, with transformers'
``LlamaTokenizerFast`` built from it, written as ``_set_vocab_sentencepiece`` writes it (tokens, scores, types).
"""

from __future__ import annotations

import inspect
import json
import random
import unicodedata
from pathlib import Path

import gguf
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from compiler.gguf_read import read_gguf_file
from compiler.gguf_tokenizer import read_tokenizer, write_tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café déjà vu: naïve façade, Ærøskøbing, Straße, Ελληνικά, русский",
    "Digits 7 42 123 1234 12345 1234567 12345678901234 3.14159 2024-06-01 1,000,000",
    "数字和中文测试，日本語のテキスト、한국어 문장",
    "Emoji 🙂🚀👍🏽 and 🇫🇷 and 👨‍👩‍👧",
    "def f(x):\n\tif x  >  1:\n\t\treturn x ** 2   # comment\n\n\n    pass\r\n}",
    "It's I'll we're they've I'd I'm DON'T 'S 'LL 'Re HE'D",
    "HelloWorld camelCase XMLHttpRequest iPhone McDONALD'S ÉcoleNormale/path\n/usr",
    "  two leading spaces and trailing   ",
    " one leading space",
    "tabs\tand\u00a0nbsp and \u3000 ideographic\u2028line separator",
    "\n\nnewlines first",
    "",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there; the world is wide.",
    "It's what we'll do: they've said I'd go, you're right, I'm sure. DON'T SHOUT, HE'LL HEAR.",
    "Café, crème brûlée, naïve, déjà vu, über, Straße, Ærøskøbing, Ελληνικά, русский язык.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n\tprint(i, add(i, 2))  # loop\n",
    "1234567890 2024 3.14159 42 100 1,000,000 phone 555-0100",
    "中文测试数字和文字，日本語のテキスト、한국어 문장입니다。",
    "Emoji 🙂 🚀 👍🏽 🇫🇷 done.",
] * 20
FUZZ_ALPHABET = list("aZé中🙂 \t\n\r0123456789'sSlLdD.,-_(){}#") + ["  ", "\u00a0", "e\u0301", "'ll", "'S", "😀"]


def fuzz_texts(count: int = 150, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 24))) for _ in range(count)]


# tokenizer.ggml.pre -> (the family's special tokens, ids 0.., its bos and eos)
FAMILIES = {
    "smollm": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>"),
    "llama-bpe": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>"),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>"),
    "gpt-2": (["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>"),
    "gpt-4o": (["<|endoftext|>", "<|user|>", "<|end|>"], None, "<|endoftext|>"),  # Phi-4-mini's
    "tekken": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),  # Mistral Nemo's
}
# the families' split regexes as published: tiktoken's o200k_base pat_str (Phi-4-mini's and gpt-oss'
# tokenizer.json), Mistral's Tekken tokenizer.json (transformers' corrected Mistral regex)
O200K_PUBLISHED = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
TEKKEN_PUBLISHED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
                    r"|\s+(?!\S)|\s+")
MERGES_IGNORED = ("llama-bpe", "tekken")  # a word that is a token is not split (and BOS is added)


def _llama3_pattern() -> str:
    """Llama 3's split regex as transformers converts Meta's tiktoken file (``TikTokenConverter``)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default


def _family_pre_tokenizer(pre: str) -> tuple[object | None, object]:
    """(normalizer, pre-tokenizer) of the family's HF tokenizer.json, used to train its vocabulary."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre == "gpt-2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False)
    pattern = {"llama-bpe": _llama3_pattern(), "gpt-4o": O200K_PUBLISHED, "tekken": TEKKEN_PUBLISHED}.get(
        pre, PRETOKENIZE_REGEX)
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return (normalizers.NFC() if pre == "qwen2" else None), pre_tokenizers.Sequence([split, byte_level])


def hf_reference(pre: str):  # noqa: ANN201 - a transformers tokenizer
    """Train a byte-level BPE vocabulary of 450 merges in the family's layout; return it as transformers'
    tokenizer of that family (Qwen2Tokenizer, GPT2Tokenizer, else PreTrainedTokenizerFast over it)."""
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

    specials, bos, eos = FAMILIES[pre]
    normalizer, pre_tokenizer = _family_pre_tokenizer(pre)
    tok = Tokenizer(BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=256 + len(specials) + 450, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    if pre == "qwen2":
        ref = Qwen2Tokenizer(vocab=vocab, merges=merges)
        ref.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
        ref.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])  # user-defined, as Qwen2.5's
        return ref
    if pre == "gpt-2":
        return GPT2Tokenizer(vocab=vocab, merges=merges)
    if pre in MERGES_IGNORED:  # Llama 3's BPE ignores merges for a word that is a token: drop the last merge so
        tok = Tokenizer(BPE(vocab, merges[:-1], ignore_merges=True))  # that its word is one only this way
        tok.pre_tokenizer = pre_tokenizer
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if pre in MERGES_IGNORED:  # tokenizer.json of Llama 3 (and Tekken) adds BOS
        tok.post_processor = processors.Sequence([tok.post_processor, processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def unmerged_word(ref) -> tuple[str, int]:  # noqa: ANN001
    """(text, id) of the token the dropped last merge made (llama-bpe): the trainer's last id."""
    last = max(ref.backend_tokenizer.get_vocab(with_added_tokens=False).values())
    return ref.decode([last]), last


def write_gguf(path: Path, hf_dir: Path, tokens: list[str], types: list[int], model: str, pre: str,
               scores: list[float] | None = None) -> Path:
    """A tensor-less GGUF with the tokenizer metadata convert_hf_to_gguf.py writes (``_set_vocab_gpt2`` /
    ``_set_vocab_sentencepiece``): merges, special ids and add_bos/add_eos read by gguf-py's SpecialVocab."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=model == "gpt2", n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fleet_tokenizer(gguf_path: Path, out: Path) -> Tokenizer:
    """fleet's tokenizer.json rebuilt from the GGUF (the coordinator loads it with tokenizers, as here)."""
    meta = read_tokenizer(read_gguf_file(str(gguf_path)), gguf_path)
    out.mkdir()
    write_tokenizer(meta, out)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def bpe_gguf(ref, tmp_path: Path, pre: str) -> Path:  # noqa: ANN001
    """``get_vocab_base``: tokens by id; added special tokens CONTROL, other added tokens USER_DEFINED."""
    ref.save_pretrained(tmp_path / "hf")
    vocab = ref.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    added = {i: t for i, t in ref.added_tokens_decoder.items()}
    tokens = [by_id[i] for i in range(len(vocab))]
    types = [(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED) if i in added
             else gguf.TokenType.NORMAL for i in range(len(tokens))]
    return write_gguf(tmp_path / f"{pre}.gguf", tmp_path / "hf", tokens, types, "gpt2", pre)


@pytest.mark.parametrize("pre", list(FAMILIES))
def test_bpe_gguf_tokenizer_equals_the_hf_tokenizer_and_round_trips(pre, tmp_path):
    from transformers import AutoTokenizer

    ref = hf_reference(pre)
    path = bpe_gguf(ref, tmp_path, pre)
    ours = fleet_tokenizer(path, tmp_path / "fleet")
    specials, bos, eos = FAMILIES[pre]
    chat = [f"{specials[-1]}user\nHi there{specials[-1]}\n", f"{eos}{eos}x", "<tool_call>{\"a\": 1}</tool_call>"]
    texts = TEXTS + chat + fuzz_texts()
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), (pre, text)
        assert ours.encode(text).ids == ref.encode(text), (pre, text)  # BOS added as the family adds it
        expected = unicodedata.normalize("NFC", text) if pre == "qwen2" else text  # Qwen2 NFC-normalizes
        assert ours.decode(ids, skip_special_tokens=False) == expected, (pre, text)
    digits = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("1234567")]
    grouped = ["123", "456", "7"]
    assert digits == {"llama-bpe": grouped, "gpt-4o": grouped, "gpt-2": ["1234567"]}.get(pre, list("1234567")), digits
    if pre in MERGES_IGNORED:  # a word that is a token but no merge makes: one token, as Llama 3's tokenizer gives
        word, token = unmerged_word(ref)
        assert ours.encode(word, add_special_tokens=False).ids == ref.encode(word, add_special_tokens=False) == [token]
    # transformers reads the files fleet wrote (tokenizer_config.json) to the same ids, BOS included
    loaded = AutoTokenizer.from_pretrained(tmp_path / "fleet")
    for text in TEXTS:
        assert loaded.encode(text) == ref.encode(text), (pre, text)
    config = json.loads((tmp_path / "fleet" / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["eos_token"]) == (pre in MERGES_IGNORED, eos)


SPM_CONTROLS = ["[INST]", "[/INST]"]  # Mistral v0.3 keeps its instruction markers as control pieces


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    """A Llama-2-style SentencePiece BPE model (byte fallback, identity normalization, whitespace kept,
    digits split) trained here, in an HF folder as Llama 2's: tokenizer.model + the special ids."""
    import io

    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=700, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, control_symbols=SPM_CONTROLS, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False}))
    return folder


def spm_gguf(folder: Path, tmp_path: Path) -> Path:
    """``_create_vocab_sentencepiece``: pieces, scores and types from the sentencepiece processor."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        kind = gguf.TokenType.NORMAL
        for check, name in ((sp.IsUnknown, "UNKNOWN"), (sp.IsControl, "CONTROL"), (sp.IsUnused, "UNUSED"),
                            (sp.IsByte, "BYTE")):
            if check(i):
                kind = gguf.TokenType[name]
                break
        types.append(kind)
    return write_gguf(tmp_path / "spm.gguf", folder, tokens, types, "llama", "default", scores)


def test_sentencepiece_gguf_tokenizer_equals_sentencepiece_and_transformers(spm_dir, tmp_path):
    import sentencepiece as spm
    from transformers import LlamaTokenizerFast

    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    ours = fleet_tokenizer(spm_gguf(spm_dir, tmp_path), tmp_path / "fleet")
    hf = LlamaTokenizerFast.from_pretrained(spm_dir)  # transformers 5: Metaspace(prepend_scheme="first")
    hf_legacy = LlamaTokenizerFast.from_pretrained(spm_dir, legacy=True)  # Metaspace "always": after specials too
    assert hf_legacy.add_bos_token and hf_legacy.bos_token_id == 1
    bytes_used = 0
    for text in TEXTS + fuzz_texts():
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text  # the original: also text starting with a space ("▁▁")
        assert ours.decode(ids) == text, text
        assert ours.encode(text).ids == [1, *ids], text  # BOS, as llama.cpp and tokenizer_config.json add it
        if not text[:1].isspace():  # transformers 5 drops the first space of a text that starts with one
            assert ids == hf.encode(text, add_special_tokens=False), text
        bytes_used += sum(ours.id_to_token(i).startswith("<0x") for i in ids)
    assert bytes_used > 20  # CJK and emoji not in the vocabulary went through byte fallback
    for text in ["<s>[INST]Hello there[/INST]Hi.</s>", "[INST]x[/INST]", "a</s>b<s>c"]:  # specials, no space after
        assert ours.encode(text, add_special_tokens=False).ids == hf_legacy.encode(text, add_special_tokens=False)
        assert ours.encode(text).ids == hf_legacy.encode(text), text
    assert ours.encode("[INST]", add_special_tokens=False).ids == [sp.PieceToId("[INST]")]


def _tiny_tokenizer_gguf(path: Path, model: str, pre: str | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("model", "pre", "named"), [("gpt2", "jais", "tokenizer.ggml.pre='jais'"),
                                                     ("gpt2", "kimi-k2", "tokenizer.ggml.pre='kimi-k2'"),
                                                     ("rwkv", "default", "tokenizer.ggml.model='rwkv'")])
def test_unknown_pre_tokenizer_or_model_is_refused_naming_the_file_and_field(model, pre, named, tmp_path):
    path = _tiny_tokenizer_gguf(tmp_path / f"{model}-{pre}.gguf", model, pre)
    with pytest.raises(ValueError) as exc:
        read_tokenizer(read_gguf_file(str(path)), path)
    assert str(exc.value).startswith(path.name) and named in str(exc.value), exc.value
    ok = _tiny_tokenizer_gguf(tmp_path / "ok.gguf", "gpt2", "gpt-2")
    assert read_tokenizer(read_gguf_file(str(ok)), ok)["merges"] == ["a b"]


def test_a_bpe_file_without_a_pre_tokenizer_splits_as_llama_cpp_default_with_a_warning(tmp_path, caplog):
    """Files converted before GGUF named pre-tokenizers: llama.cpp warns and splits by its 'default' regexes
    (punctuation runs, GPT-2's, digit runs, then threes), each applied to the pieces the one before left."""
    path = _tiny_tokenizer_gguf(tmp_path / "old.gguf", "gpt2", None)
    with caplog.at_level("WARNING"):
        ours = fleet_tokenizer(path, tmp_path / "fleet")
    assert "no tokenizer.ggml.pre" in caplog.text
    pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("Hello, world 1234")]
    assert pieces == ["Hello", ",", "Ġworld", "Ġ", "123", "4"], pieces


def _vocab_gguf(path: Path, tokens: list[str], types: list[int]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b"])
    writer.add_token_types(types)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_harmony_vocabulary_ends_at_return_and_call_not_at_end_and_shows_its_markers(tmp_path):
    """gpt-oss (o200k_harmony) ends every message, the reasoning's too, with <|end|> and the answer with <|return|>
    (a tool call with <|call|>): as llama.cpp, generation stops at those two and <|end|> only where they are absent
    (Phi-3's vocabulary); harmony's markers are rendered in the output (user-defined), as llama.cpp renders them."""
    control = gguf.TokenType.CONTROL
    harmony = ["a", "b", "ab", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
               "<|call|>"]
    p = _vocab_gguf(tmp_path / "h.gguf", harmony, [1, 1, 1] + [control] * 7)
    meta = read_tokenizer(read_gguf_file(str(p)), p)
    assert [harmony[i] for i in meta["eog_ids"]] == ["<|return|>", "<|call|>"], meta["eog_ids"]
    marked = {harmony[i] for i, kind in enumerate(meta["types"]) if kind == gguf.TokenType.USER_DEFINED}
    assert marked == {"<|start|>", "<|message|>", "<|channel|>"}, marked
    ours = fleet_tokenizer(p, tmp_path / "fleet")
    ids = ours.encode("<|channel|>ab<|message|>a", add_special_tokens=False).ids
    assert ids == [7, 2, 6, 0] and ours.decode(ids, skip_special_tokens=True) == "<|channel|>ab<|message|>a"
    phi3 = ["a", "b", "ab", "<|endoftext|>", "<|end|>"]
    p = _vocab_gguf(tmp_path / "p.gguf", phi3, [1, 1, 1, control, control])
    meta = read_tokenizer(read_gguf_file(str(p)), p)
    assert [phi3[i] for i in meta["eog_ids"]] == ["<|end|>"]
