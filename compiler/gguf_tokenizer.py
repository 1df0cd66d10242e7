"""A GGUF file's tokenizer metadata -> Hugging Face tokenizer files, built with the ``tokenizers`` library.

Two kinds of GGUF vocabularies (``tokenizer.ggml.model``), rebuilt as llama.cpp tokenizes them
(``src/llama-vocab.cpp``: ``llama_vocab::impl::load``, ``llm_tokenizer_bpe``, ``llm_tokenizer_spm_session``):

* ``gpt2``, byte-level BPE: tokens + merges, split before BPE by the regexes of the file's pre-tokenizer
  (``tokenizer.ggml.pre``, ``BPE_PRE``), each an isolated ``Split`` ahead of ``ByteLevel`` without its own
  regex, as the families' HF ``tokenizer.json`` files do: GPT-2's, Llama 3's (and cl100k's), Qwen2's, o200k's
  (``gpt-4o``: Phi-4-mini, gpt-oss), Tekken's (Mistral Nemo, Small 3), and llama.cpp's ``default`` split for
  a file that names none. ``smollm`` keeps SmolLM2's own layout (``Digits``
  then ``ByteLevel``'s GPT-2 regex: llama.cpp's ``\\p{N}`` + GPT-2 regexes) so the demo's ``tokenizer.json``
  stays byte for byte what it was. Llama 3 ignores merges when a whole word is a token
  (``BPE(ignore_merges=True)``, llama.cpp's ``ignore_merges``) and adds BOS; Qwen2's text is NFC-normalized
  first, as its HF tokenizer does (llama.cpp does not).
* ``llama``, SentencePiece (Llama 2, Mistral): tokens + scores + token types, laid out as transformers'
  ``LlamaConverter`` lays out Llama 2's ``tokenizer.json``: BPE with byte fallback over the pieces, merges
  derived from the scores (the highest-scoring piece merges first, as llama.cpp's SPM tokenizer picks the
  best-scoring bigram), the space prefix (``tokenizer.ggml.add_space_prefix``, default true) as a
  ``Prepend("▁")`` + ``Replace(" ", "▁")`` normalizer, decoders Replace/ByteFallback/Fuse/Strip.
  The normalizer form (transformers' ``legacy`` layout), not transformers 5's ``Metaspace(prepend_scheme=
  "first")``, because it is what sentencepiece and llama.cpp do: every text segment gets the prefix, also one
  after a special token and one that starts with a space (``" Hi"`` -> ``▁▁Hi``), so decoding gives back the
  exact text. transformers 5 differs only there (it drops a leading space and prefixes the first segment only).

Token types (llama.cpp ``LLAMA_TOKEN_TYPE_*``): control and unknown tokens become special added tokens,
user-defined ones plain added tokens (matched before the model, never split), byte tokens ``<0xNN>`` the
byte fallback. BOS/EOS are added by the post-processor as llama.cpp adds them (``tokenizer.ggml.add_bos_token``
/ ``add_eos_token`` when the file has them, else llama.cpp's default: BOS for Llama 3 and SentencePiece).
Gemma's vocabulary is this SentencePiece kind with ``add_space_prefix`` false (no ``Prepend``, no ``Strip``), its
turn markers control tokens (tested against transformers' GemmaTokenizer, tests/unit/test_gguf_gemma_vocab.py).

A file without ``tokenizer.chat_template`` gets the built-in template of the chat format its special tokens
show (``compiler/chat_templates.py``, llama.cpp's built-in list), named in ``tokenizer_config.json``
(``fleet_chat_template``) and in the build's log; with no known format it gets none.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat_templates import builtin_template
from .gguf import field

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp LLAMA_TOKEN_TYPE_*
SPACE = "\u2581"  # "▁", SentencePiece's whitespace

# llama.cpp's split regexes (src/llama-vocab.cpp, llm_tokenizer_bpe; ggml-org/llama.cpp @ 00ad355e), the
# case-insensitive contractions of the HF originals spelled out (llama.cpp PR 6920)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # single digits
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Cased words (an uppercase run ends a piece when a lowercase run follows): the o200k regex of GPT-4o's
# tokenizer (tiktoken's o200k_base; Phi-4-mini, gpt-oss, Llama 4), its contraction a suffix of the word, and
# Tekken's (Mistral Nemo, Small 3, Ministral; transformers' corrected Mistral regex), with no contractions and
# single digits. As the families' tokenizer.json files write them: llama.cpp spells the same splits out for
# its own regex engine (LLAMA_VOCAB_PRE_TYPE_GPT4O, _TEKKEN).
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"


def _cased_regex(contraction: str, digits: str) -> str:
    word = r"[^\r\n\p{L}\p{N}]?"
    return (f"{word}{_UPPER}*{_LOWER}+{contraction}|{word}{_UPPER}+{_LOWER}*{contraction}|{digits}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


O200K_REGEX = _cased_regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}")
TEKKEN_REGEX = _cased_regex("", r"\p{N}")
# llama.cpp's split for a BPE file with no (or the "default") pre-tokenizer, as older conversions are
DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class BpePre:
    """How one llama.cpp pre-tokenizer type splits text before byte-level BPE (llama-vocab.cpp)."""

    regexes: tuple[str, ...]  # applied in order, each match isolated
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    ignore_merges: bool = False  # a word that is itself a token is not split by merges
    nfc: bool = False  # NFC-normalize first (the family's HF tokenizer does; llama.cpp does not)
    smollm_layout: bool = False  # SmolLM2's tokenizer.json layout (Digits + ByteLevel regex)


_LLAMA3 = BpePre((LLAMA3_REGEX,), add_bos=True, ignore_merges=True)
_QWEN2 = BpePre((QWEN2_REGEX,), nfc=True)
_GPT4O = BpePre((O200K_REGEX,))
_GPT2 = BpePre((GPT2_REGEX,))
_CL100K = BpePre((LLAMA3_REGEX,))  # Llama 3's split without its merge rule and BOS (llama.cpp's DBRX type)
BPE_PRE = {  # tokenizer.ggml.pre -> how it splits (llama.cpp's names for the same type share one entry)
    "smollm": BpePre((r"\p{N}", GPT2_REGEX), smollm_layout=True),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "gpt-2": _GPT2, "phi-2": _GPT2,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
    "tekken": BpePre((TEKKEN_REGEX,), add_bos=True, ignore_merges=True),
    "dbrx": _CL100K, "smaug-bpe": _CL100K,
    "default": BpePre(DEFAULT_REGEXES),
}
MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values: byte-level BPE, SentencePiece
# chat turns' end tokens llama.cpp ends generation at (llama-vocab.cpp, special_eog_ids by text) that the families'
# HF generation_config.json lists beside eos too (Llama 3, Qwen, Phi-3, Gemma); document ends (<|endoftext|>) are
# left to the file's eos id. gpt-oss's harmony format ends a message with <|end|> but the answer with <|return|> (or
# a tool call with <|call|>): a vocabulary with both of those keeps <|end|> out (llama.cpp's o200k_harmony rule)
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|return|>", "<|call|>")
HARMONY_ENDS, HARMONY_MESSAGE_END = ("<|return|>", "<|call|>"), "<|end|>"
# harmony's structure markers, which llama.cpp always renders (user-defined: matched in input, kept in output text)
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def read_tokenizer(reader: Any, gguf_path: Path) -> dict[str, Any]:
    """Read and check the tokenizer metadata of an open GGUF file (gguf-py ``GGUFReader``).

    Returns:
        A dict: ``model`` (``gpt2``/``llama``), ``pre``, ``tokens``, ``types`` (ints, one per token),
        ``merges`` (BPE) or ``scores`` (SentencePiece), ``bos_id``/``eos_id``/``unk_id``/``pad_id`` (int or
        None; pad defaults to eos), ``eog_ids`` (:func:`end_of_turn_ids`), ``add_bos``/``add_eos``/
        ``add_space_prefix``, ``chat_template``, ``architecture`` and ``context_length``.

    Raises:
        ValueError: naming the file and the field: an unknown ``tokenizer.ggml.model`` or (for BPE)
            ``tokenizer.ggml.pre``, or tokens, merges, scores, types or the eos id missing or inconsistent.
    """
    name = Path(gguf_path).name
    model, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")
    if model not in MODELS:
        raise ValueError(f"{name}: unsupported GGUF tokenizer: tokenizer.ggml.model={model!r}; fleet rebuilds "
                         "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")
    if model == "gpt2" and pre is None:  # converted before GGUF named pre-tokenizers: llama.cpp's default split
        log.warning("%s: no tokenizer.ggml.pre: splitting as llama.cpp's 'default' pre-tokenizer (llama.cpp warns "
                    "its generation quality may be degraded; a newer conversion of the model names its own)", name)
        pre = "default"
    if model == "gpt2" and pre not in BPE_PRE:
        raise ValueError(f"{name}: unsupported GGUF pre-tokenizer: tokenizer.ggml.pre={pre!r} "
                         f"(tokenizer.ggml.model='gpt2'); fleet rebuilds {', '.join(BPE_PRE)}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    if not tokens:
        raise ValueError(f"{name}: tokenizer.ggml.tokens missing or empty")
    if types is None or len(types) != len(tokens):
        raise ValueError(f"{name}: tokenizer.ggml.token_type missing or not one per token")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{name}: tokenizer.ggml.tokens has duplicate tokens")
    arch = field(reader, "general.architecture", "llama")
    meta: dict[str, Any] = {
        "model": model, "pre": pre, "tokens": tokens,
        "types": [USER_DEFINED if text in HARMONY_MARKERS else int(t) for text, t in zip(tokens, types)],
        "chat_template": field(reader, "tokenizer.chat_template"), "architecture": arch,
        "context_length": int(field(reader, f"{arch}.context_length", 2048)),
    }
    if model == "gpt2":
        meta["merges"] = field(reader, "tokenizer.ggml.merges")
        if not meta["merges"]:
            raise ValueError(f"{name}: tokenizer.ggml.merges missing or empty")
        bad = next((m for m in meta["merges"] if len(m.split(" ")) != 2 or "" in m.split(" ")), None)
        if bad is not None:
            raise ValueError(f"{name}: tokenizer.ggml.merges entry {bad!r} is not two tokens and one space")
    else:
        meta["scores"] = field(reader, "tokenizer.ggml.scores")
        if meta["scores"] is None or len(meta["scores"]) != len(tokens):
            raise ValueError(f"{name}: tokenizer.ggml.scores missing or not one per token")
    meta |= _special_ids(reader, name, model, len(tokens))
    meta["eog_ids"] = end_of_turn_ids(reader, tokens, meta["eos_id"])
    spm = model == "llama"
    meta["add_bos"] = bool(field(reader, "tokenizer.ggml.add_bos_token", spm or BPE_PRE[pre].add_bos))
    meta["add_eos"] = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    meta["add_space_prefix"] = spm and bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    for flag, key in (("add_bos", "bos_id"), ("add_eos", "eos_id")):
        if meta[flag] and meta[key] is None:
            raise ValueError(f"{name}: tokenizer.ggml.{flag}_token is true but tokenizer.ggml.{key[:3]}_token_id "
                             "is missing")
    return meta


def end_of_turn_ids(reader: Any, tokens: list[str], eos_id: int) -> list[int]:
    """Ids that end generation beside eos, as llama.cpp's: ``tokenizer.ggml.eot_token_id`` and
    ``eom_token_id`` when the file has them, and the ``END_OF_TURN`` tokens by their text (sorted, eos left out),
    but for a harmony vocabulary (gpt-oss: ``<|return|>`` and ``<|call|>``) not ``<|end|>``, which ends each of its
    messages (the reasoning's too), not the answer."""
    ids = {int(v) for v in (field(reader, "tokenizer.ggml.eot_token_id"), field(reader, "tokenizer.ggml.eom_token_id"))
           if v is not None and 0 <= int(v) < len(tokens)}
    ids |= {i for i, text in enumerate(tokens) if text in END_OF_TURN}
    texts = {tokens[i] for i in ids}
    if all(end in texts for end in HARMONY_ENDS):  # harmony: a message's end is not the answer's
        ids -= {i for i in ids if tokens[i] == HARMONY_MESSAGE_END}
    return sorted(ids - {eos_id})


def _special_ids(reader: Any, name: str, model: str, n_tokens: int) -> dict[str, int | None]:
    """bos/eos/unk/pad ids; a SentencePiece file without them gets llama.cpp's defaults (1, 2, 0). An id
    outside the vocabulary is dropped with a warning, as llama.cpp does (then pad falls back to eos)."""
    defaults = {"bos_id": 1, "eos_id": 2, "unk_id": 0} if model == "llama" else {}
    ids: dict[str, int | None] = {}
    for key, gkey in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"),
                      ("unk_id", "unknown_token_id"), ("pad_id", "padding_token_id")):
        value = field(reader, f"tokenizer.ggml.{gkey}", defaults.get(key))
        if value is not None and not 0 <= int(value) < n_tokens:
            log.warning("%s: tokenizer.ggml.%s=%d is outside the vocabulary of %d tokens: ignored", name, gkey,
                        int(value), n_tokens)
            value = None
        ids[key] = None if value is None else int(value)
    if ids["eos_id"] is None:
        raise ValueError(f"{name}: tokenizer.ggml.eos_token_id missing or not a token id")
    if ids["pad_id"] is None:
        ids["pad_id"] = ids["eos_id"]
    return ids


def write_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with the GGUF's chat template) and
    ``special_tokens_map.json`` for the metadata :func:`read_tokenizer` returned."""
    tok = _spm_tokenizer(meta) if meta["model"] == "llama" else _bpe_tokenizer(meta)
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    _write_configs(meta, Path(out_dir))


def _added_tokens(meta: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """Added tokens for control/unknown (special) and user-defined (plain) tokens, and the special ones' text."""
    from tokenizers import AddedToken

    added, specials = [], []
    for text, kind in zip(meta["tokens"], meta["types"]):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            special = kind != USER_DEFINED
            added.append(AddedToken(text, special=special, normalized=False))
            if special:
                specials.append(text)
    return added, specials


def _post_processor(meta: dict[str, Any], byte_level: bool) -> Any:
    """ByteLevel offsets (BPE) and BOS/EOS as llama.cpp adds them (transformers' ``update_post_processor``
    template: ``bos $A eos``, pairs ``bos $A eos bos $B eos``); None when there is nothing to do."""
    from tokenizers import processors

    steps = [processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)] if byte_level else []
    ends = [(meta[flag], meta[key]) for flag, key in (("add_bos", "bos_id"), ("add_eos", "eos_id"))]
    if any(add for add, _ in ends):
        (add_bos, bos_id), (add_eos, eos_id) = ends
        bos, eos = meta["tokens"][bos_id] if add_bos else None, meta["tokens"][eos_id] if add_eos else None

        def template(seq: str, type_id: int) -> list[str]:
            return [*([f"{bos}:{type_id}"] if bos else []), f"${seq}:{type_id}", *([f"{eos}:{type_id}"] if eos else [])]

        specials = {tok: idx for tok, idx in ((bos, bos_id), (eos, eos_id)) if tok}
        steps.append(processors.TemplateProcessing(single=template("A", 0), pair=template("A", 0) + template("B", 1),
                                                   special_tokens=list(specials.items())))
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def _bpe_tokenizer(meta: dict[str, Any]) -> Any:
    """Byte-level BPE over the GGUF's tokens and merges, split by its pre-tokenizer's regexes."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(meta["tokens"])}
    merges = [tuple(line.split(" ")) for line in meta["merges"]]  # checked by read_tokenizer
    pre = BPE_PRE[meta["pre"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=False, fuse_unk=False, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre.smollm_layout:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False) for regex in pre.regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = _post_processor(meta, byte_level=True)
    added, _ = _added_tokens(meta)
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges from SentencePiece pieces: every split of a normal piece into two normal pieces, ranked by
    the piece's score (highest first; ties by id, then the shorter left part), the order in which llama.cpp's
    SPM tokenizer merges bigrams (``llm_tokenizer_spm_session``) and transformers derives merges
    (``generate_merges``). O(total piece length)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            if piece[:k] in normal and piece[k:] in normal:
                ranked.append((-float(scores[i]), i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def _spm_tokenizer(meta: dict[str, Any]) -> Any:
    """SentencePiece pieces as BPE with byte fallback (transformers' LlamaConverter layout, legacy form)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = meta["tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = spm_merges(tokens, meta["scores"], meta["types"])
    unk = tokens[meta["unk_id"]] if meta["unk_id"] is not None else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace] if meta["add_space_prefix"]
                                          else [replace])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta["add_space_prefix"]:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    processor = _post_processor(meta, byte_level=False)
    if processor is not None:
        tok.post_processor = processor
    added, _ = _added_tokens(meta)
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    return tok


def _write_configs(meta: dict[str, Any], out_dir: Path) -> None:
    """``special_tokens_map.json`` and ``tokenizer_config.json`` (PreTrainedTokenizerFast: transformers loads
    ``tokenizer.json`` as written, where a Llama class would rebuild it in its own layout)."""
    tokens = meta["tokens"]
    _, specials = _added_tokens(meta)

    def name(idx: int | None) -> str | None:
        return None if idx is None else tokens[idx]

    special_map = {
        "bos_token": name(meta["bos_id"]),
        "eos_token": name(meta["eos_id"]),
        "pad_token": name(meta["pad_id"]),
        "unk_token": name(meta["unk_id"]),
        "additional_special_tokens": [t for t in specials if t in (name(meta["bos_id"]), name(meta["eos_id"]))],
    }
    special_map = {k: v for k, v in special_map.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": meta["add_bos"],
        "add_eos_token": meta["add_eos"],
        "add_prefix_space": meta["add_space_prefix"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["context_length"],
    }
    template, source = chat_template(meta)
    if template:
        config |= {"chat_template": template, "fleet_chat_template": source}
    for fname, data in (("special_tokens_map.json", special_map), ("tokenizer_config.json", config)):
        (out_dir / fname).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def chat_template(meta: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template for the tokenizer files and where it came from: the GGUF's ``tokenizer.chat_template``
    (source ``gguf``), else the built-in one of the format its special tokens show (``builtin:<name>``, logged),
    else ``(None, "none")`` with a warning: chat requests are then refused, completions work."""
    if meta["chat_template"]:
        return meta["chat_template"], "gguf"
    arch = meta.get("architecture", "?")
    found = builtin_template(set(meta["tokens"]), meta["add_bos"])
    if found is None:
        log.warning("the GGUF (architecture %s) has no tokenizer.chat_template and its vocabulary shows no chat format "
                    "fleet knows: chat requests will be refused, completions work", arch)
        return None, "none"
    name, template = found
    log.info("the GGUF (architecture %s) has no tokenizer.chat_template: using fleet's built-in %r chat template "
             "(from its special tokens)", arch, name)
    return template, f"builtin:{name}"
