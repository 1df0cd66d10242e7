"""What grammar-constrained decoding costs per token: llguidance (fleet's, ``coordinator/engine/constraint.py``) beside
xgrammar, at the demo's 49,152-token vocabulary and at Gemma 3's 262,144, on the twenty JSON schemas of
``tests/compat/schemas.py`` plus ``json_object`` (``{"type": "object"}``); table + JSON.

Per library and vocabulary:

* the tokenizer's preparation (once per model: llguidance's ``LLTokenizer``, xgrammar's ``TokenizerInfo``);
* each schema's compile time, first and again (xgrammar caches compiled grammars; llguidance compiles lazily, so
  its "first" includes nothing of the mask work it does later);
* the allowed-token bitmask of every position along real token paths (the same paths for both libraries):
  mean / p50 / p99 µs, and the advance past the chosen token; ``same mask`` is the share of positions where
  both libraries allow exactly the same tokens (they read JSON schema's corners differently).

The paths: with ``--url`` the fleet's own greedy answers (``fleet.completion_token_ids``; tests/compat's
request per schema, ``response_format: json_object`` for the last; the same paths at both vocabularies, the
larger one's first 49,152 tokens being the demo's); without it, tokens drawn uniformly from llguidance's
allowed set with a fixed seed (a token that would end the grammar early drawn again), to the grammar's end or
``--tokens`` (64). Each path is timed ``--repeat`` times (fresh matchers, compiled grammar
reused); a position's time is the median of its repeats.

Fleet's own path per token (``fleet path``): ``Matcher.fill`` (llguidance's mask into the step's buffer), the
advance (``Matcher.consume``), the last stage's ``fleet_common.runtime.unpack_token_mask`` and the extra cost of
the masked top-k (``top_candidates(allowed=...)`` less the unmasked one, k = 1 greedy and k = 64 sampling);
its share of a token's time, the token's time being ``--token-ms`` (defaults measured on this machine: the
demo 2-stage fleet decodes at 12-50 tok/s, so 20 ms is its fastest; a model of Gemma 3 1B's dimensions ~10
tok/s, 100 ms), or, with ``--url URL`` of a running fleet, the fleet's own numbers: each response's
``fleet.grammar.mask_ms`` over its decode time (``completion_tokens - 1`` over ``fleet.decode_tokens_per_s``).
``draft step``: the masks of one verify step with 4 drafts, fleet's per-position loop (``Matcher.masks``)
beside llguidance's batch call (``LLExecutor.unsafe_compute_mask_ptr_with_draft_token``, 1 thread).

The 262,144-token vocabulary: no tokenizer of that size can be downloaded here, so it is the demo's byte-level
BPE plus 212,992 tokens, each the concatenation of two of its non-special tokens drawn with a fixed seed
(unique, not already a token; ids 49,152 up), each of a length drawn from the demo tokens' lengths: mean
8.3 bytes against the demo's 6.8 (short lengths run out of unique pairs; plain pairs would average 12.3 bytes,
63,375 tokens of 16 or more, a trie far deeper than a real vocabulary's): a trie 5x as large grown from real
prefixes, so the mask walks (llguidance's trie walk, xgrammar's per-state
token caches) meet as many tokens that run on past a lexeme's end as a large real vocabulary has. It is a
tokenizer.json like any other (no merges make the new tokens: the libraries only read the tokens' bytes).

    python bench/pipeline/grammar_bench.py [--vocab 49152,262144] [--libraries llguidance,xgrammar] [--repeat 3]
                                  [--tokens 64] [--token-ms 49152=20,262144=100] [--url http://127.0.0.1:8000]
                                  [--tokenizer models/test/SmolLM2-135M-Instruct/tokenizer.json] [--json PATH]

xgrammar needs torch, transformers and triton, so it is no dependency of fleet; for this bench only (torch and
transformers are in the dev environment): ``.venv/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi``.
Without it the bench measures llguidance alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import harness
from coordinator.engine.constraint import Constraint, Grammars, Matcher, mask_words
from fleet_common.runtime import top_candidates, unpack_token_mask

ROOT = Path(__file__).resolve().parents[2]
DEMO_TOKENIZER = ROOT / "models" / "test" / "SmolLM2-135M-Instruct" / "tokenizer.json"
EOS = 2  # <|im_end|>, the demo's end of sequence
DRAFTS = 4


def grammars_under_test() -> list[tuple[str, dict]]:
    """(name, JSON schema): tests/compat/schemas.py's twenty, then ``json_object``."""
    sys.path.insert(0, str(ROOT))
    from tests.compat.schemas import SCHEMAS

    return [(name, schema) for name, _, schema in SCHEMAS] + [("json_object", {"type": "object"})]


def demo_tokenizer_json(path: Path = DEMO_TOKENIZER) -> str:
    """The demo model's tokenizer.json text (49,152 byte-level BPE tokens), fetched with
    ``compiler.source.fetch_demo`` into ``path``'s folder when missing."""
    if not path.exists():
        from compiler.source import fetch_demo

        fetch_demo(path.parent)
    return path.read_text()


def extend_vocabulary(tokenizer_json: str, size: int, seed: int = 0) -> str:
    """``tokenizer_json`` (a byte-level BPE tokenizer.json) with its vocabulary grown to ``size`` tokens: each new
    token (ids from the current size up) the concatenation of two existing non-special tokens drawn with
    ``random.Random(seed)``, unique, its length (in bytes) drawn from the existing tokens' lengths, so that the
    vocabulary's length distribution stays a real one's. Raises ``ValueError`` if ``size`` is below the
    current size."""
    spec = json.loads(tokenizer_json)
    vocab: dict[str, int] = spec["model"]["vocab"]
    if size < len(vocab):
        raise ValueError(f"the vocabulary already has {len(vocab)} tokens, more than {size}")
    special = {token["id"] for token in spec["added_tokens"]}
    pieces = [piece for piece, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i not in special]
    by_length: dict[int, list[str]] = {}
    for piece in pieces:
        by_length.setdefault(len(piece), []).append(piece)
    rng = random.Random(seed)
    next_id = len(vocab)
    while next_id < size:
        length, head = len(rng.choice(pieces)), rng.choice(pieces)  # a real token's length; the first part
        if not (tails := by_length.get(length - len(head))):
            continue
        piece = head + rng.choice(tails)
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    return json.dumps(spec, ensure_ascii=False)


class Llguidance:
    """fleet's path: ``coordinator.engine.constraint`` over llguidance (``Grammars``, ``Matcher``)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int) -> None:
        self.grammars = Grammars(lambda: tokenizer_json, vocab_size, {EOS})
        t0 = time.perf_counter()
        self.grammars.tokenizer()
        self.prepare_s = time.perf_counter() - t0

    def compile(self, schema: dict) -> str:
        """The llguidance grammar of ``schema`` (fleet's JSON options)."""
        return Constraint.json_schema(schema).grammar()

    def raw_matcher(self, grammar: str):
        import llguidance

        return llguidance.LLMatcher(self.grammars.tokenizer(), grammar, log_level=0)

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(self.raw_matcher(grammar), self.grammars.vocab_size)

    def first_compile(self, schema: dict) -> None:
        """Everything a request's first step needs before its first mask: schema to grammar to matcher."""
        self.matcher(self.compile(schema))

    @staticmethod
    def fill(matcher: Matcher, out: np.ndarray) -> None:
        matcher.fill(out)

    @staticmethod
    def advance(matcher: Matcher, token: int) -> bool:
        matcher.consume(token)  # the paths are llguidance's: it never refuses one
        return True


class Xgrammar:
    """xgrammar's Python API as its docs use it: ``TokenizerInfo.from_huggingface``, ``GrammarCompiler``
    (1 thread, cache on), ``GrammarMatcher.fill_next_token_bitmask``; compact JSON like fleet's."""

    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int) -> None:
        import torch
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        torch.set_num_threads(1)
        self.xgr = xgrammar
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="<|im_end|>")
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[EOS])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.prepare_s = time.perf_counter() - t0
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.view = self.bitmask.numpy()[0]  # shares the tensor's memory

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=True)

    def first_compile(self, schema: dict) -> None:
        self.compiler.clear_cache()
        self.matcher(self.compile(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, out: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)
        out[:] = self.view

    @staticmethod
    def advance(matcher, token: int) -> bool:
        return matcher.accept_token(int(token))


def allowed_ids(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask [ceil(V / 32)] int32 allows."""
    return np.flatnonzero(unpack_token_mask(mask[None], vocab_size)[0])


def random_path(lib: Llguidance, grammar: str, tokens: int, rng: np.random.Generator) -> list[int]:
    """Up to ``tokens`` tokens drawn uniformly from the grammar's allowed set (never the end of sequence; a
    token that would end the grammar before ``tokens`` is drawn again, up to 8 times), to the grammar's end."""
    matcher, out, path = lib.matcher(grammar), np.empty(mask_words(lib.grammars.vocab_size), np.int32), []
    while len(path) < tokens and not matcher.stopped:
        matcher.fill(out)
        ids = allowed_ids(out, lib.grammars.vocab_size)
        ids = ids[ids != EOS]
        if not len(ids):
            break
        for _ in range(8):  # a token that ends the grammar early is drawn again (up to 8 times)
            token = int(rng.choice(ids))
            matcher.consume(token)
            if not matcher.stopped or len(path) + 1 == tokens:
                break
            matcher.rollback(1)
        else:
            matcher.consume(token)
        path.append(token)
    return path


def valid_prefix(lib: Llguidance, grammar: str, path: list[int], tokens: int) -> list[int]:
    """The longest prefix (at most ``tokens``) of ``path`` the grammar allows (a fleet answer's final end of
    sequence and anything after the grammar's end are cut)."""
    matcher, out, kept = lib.matcher(grammar), np.empty(mask_words(lib.grammars.vocab_size), np.int32), []
    for token in path[:tokens]:
        if matcher.stopped or token == EOS:
            break
        matcher.fill(out)
        if not (int(out[token >> 5]) >> (token & 31)) & 1:
            break
        matcher.consume(token)
        kept.append(token)
    return kept


@dataclass
class Walk:
    """One library's timings along one vocabulary's paths: per position (µs, medians over repeats)."""

    mask_us: list[float] = field(default_factory=list)
    advance_us: list[float] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)  # the last repeat's masks, for the agreement check
    refused: int | None = None  # the position of the first path token this library refuses


def walk(lib, compiled, path: list[int], repeat: int, words: int) -> Walk:
    """Time ``lib``'s mask and advance at each position of ``path`` (plus the mask after it), ``repeat`` times;
    a token the library refuses ends its walk there."""
    masks = np.empty((len(path) + 1, words), np.int32)
    fill_t, advance_t, refused = [], [], None
    for _ in range(repeat):
        matcher, fills, advances = lib.matcher(compiled), [], []
        for i in range(len(path) + 1):
            t0 = time.perf_counter()
            lib.fill(matcher, masks[i])
            fills.append(time.perf_counter() - t0)
            if i == len(path):
                break
            t0 = time.perf_counter()
            accepted = lib.advance(matcher, path[i])
            advances.append(time.perf_counter() - t0)
            if not accepted:
                refused = i
                break
        fill_t.append(fills)
        advance_t.append(advances)
    per = lambda runs: [statistics.median(r) * 1e6 for r in zip(*runs)]
    return Walk(per(fill_t), per(advance_t), list(masks[:len(fill_t[0])]), refused)


def special_ids(tokenizer_json: str) -> list[int]:
    """The ids of a tokenizer.json's special added tokens."""
    return [token["id"] for token in json.loads(tokenizer_json)["added_tokens"] if token.get("special")]


def agreement(schemas: list[tuple[str, dict]], ours: list[Walk], theirs: list[Walk], special: list[int],
              vocab_size: int) -> dict:
    """Where two libraries' walks allow the same tokens: ``same_mask``, the share of positions both reached
    with equal masks once the special tokens are left out (xgrammar allows them as literal text inside JSON
    strings, llguidance never), ``special_allowed`` the share where the other allows some special token,
    ``refused`` {schema: position} where the other refuses a path token llguidance allowed."""
    same = with_special = total = 0
    differing, refused = [], {}
    for (name, _), a, b in zip(schemas, ours, theirs):
        ok = True
        for x, y in zip(a.masks, b.masks):
            bits_x, bits_y = unpack_token_mask(x[None], vocab_size)[0], unpack_token_mask(y[None], vocab_size)[0]
            with_special += bool(bits_y[special].any() and not bits_x[special].any())
            bits_x[special] = bits_y[special] = False
            equal = bool(np.array_equal(bits_x, bits_y))
            same, total, ok = same + equal, total + 1, ok and equal
        if not ok:
            differing.append(name)
        if b.refused is not None:
            refused[name] = b.refused
    return {"same_mask": same / total, "special_allowed": with_special / total, "differing": differing,
            "refused": refused}


def summary(values: list[float]) -> dict:
    """mean / p50 / p99 / max of ``values`` (µs or ms)."""
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": int(a.size)}


def compile_times(lib, schemas: list[tuple[str, dict]], repeat: int) -> dict:
    """Per schema: first compile (schema to a matcher, nothing cached) and again (ms, medians over repeats)."""
    first, again = {}, {}
    for name, schema in schemas:
        runs_first, runs_again = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            lib.first_compile(schema)
            runs_first.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lib.matcher(lib.compile(schema))
            runs_again.append(time.perf_counter() - t0)
        first[name], again[name] = statistics.median(runs_first) * 1e3, statistics.median(runs_again) * 1e3
    return {"first_ms": first, "again_ms": again}


def time_us(fn, repeat: int = 7) -> float:
    """Median µs of ``fn()`` over ``repeat`` calls."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6


def last_stage_us(masks: list[np.ndarray], vocab_size: int, seed: int = 0) -> dict:
    """The last stage's share of a masked step on real masks: unpack, masked and unmasked top-k (k = 1, 64),
    µs per position (medians over ``masks``)."""
    logits = np.random.default_rng(seed).standard_normal((1, vocab_size), dtype=np.float32)
    picked = masks[:: max(1, len(masks) // 48)]
    unpack = [time_us(lambda m=m: unpack_token_mask(m[None], vocab_size)) for m in picked]
    out = {"unpack": statistics.median(unpack)}
    for k in (1, 64):
        masked = [time_us(lambda m=m, k=k: top_candidates(logits, k, unpack_token_mask(m[None], vocab_size)))
                  for m in picked]
        plain = time_us(lambda k=k: top_candidates(logits, k), 15)
        out[f"topk{k}_extra"] = max(0.0, statistics.median(masked) - statistics.median(unpack) - plain)
        out[f"topk{k}_plain"] = plain
    return out


def draft_step_us(lib: Llguidance, grammars: list[str], paths: list[list[int]], repeat: int) -> dict:
    """One verify step's masks with ``DRAFTS`` drafts at every position of every path: fleet's per-position
    loop (``Matcher.masks``) vs llguidance's batch call (``LLExecutor``, 1 thread), µs per step (medians)."""
    import llguidance

    executor, words = llguidance.LLExecutor(num_threads=1), mask_words(lib.grammars.vocab_size)
    loop, batch = [], []
    buffer = np.empty((DRAFTS + 1, words), np.int32)
    for grammar, path in zip(grammars, paths):
        raw = lib.raw_matcher(grammar)
        matcher = Matcher(raw, lib.grammars.vocab_size)
        for i in range(max(0, len(path) - DRAFTS)):
            draft = path[i:i + DRAFTS]
            loop.append(time_us(lambda d=draft, m=matcher: m.masks(d), repeat))
            batch.append(time_us(lambda d=draft, r=raw: executor.unsafe_compute_mask_ptr_with_draft_token(
                [(r, 0, d)], buffer.ctypes.data, words * 4, DRAFTS + 1), repeat))
            matcher.consume(path[i])
    return {"loop_us": statistics.median(loop), "batch_us": statistics.median(batch), "steps": len(loop)}


def fleet_answers(url: str, schemas: list[tuple[str, dict]]) -> dict[str, dict]:
    """Each schema's greedy answer from the running fleet at ``url`` (tests/compat/schemas.py's request;
    ``json_object`` as ``response_format: json_object``): its token ids and the grammar's cost as the fleet
    reports it (``fleet.grammar``), against its decode time."""
    import httpx

    from tests.compat.schemas import MAX_TOKENS, SCHEMAS, chat_body

    prompts = {name: prompt for name, prompt, _ in SCHEMAS}
    out = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for name, schema in schemas:
            if name in prompts:
                body = chat_body(name, prompts[name], schema)
            else:
                body = {"messages": [{"role": "user", "content": "Describe your day. Answer in JSON."}],
                        "temperature": 0, "max_tokens": MAX_TOKENS, "response_format": {"type": "json_object"}}
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            reply = response.json()
            stats, tokens = reply["fleet"], reply["usage"]["completion_tokens"]
            rate = stats.get("decode_tokens_per_s")
            decode_ms = (tokens - 1) / rate * 1e3 if rate else None
            mask_ms = stats["grammar"]["mask_ms"]
            out[name] = {"ids": stats["completion_token_ids"], "tokens": tokens, "masks": stats["grammar"]["masks"],
                         "mask_ms": mask_ms, "decode_tokens_per_s": rate, "decode_ms": decode_ms,
                         "share": mask_ms / decode_ms if decode_ms else None}
    return out


def measure_vocabulary(text: str, vocab_size: int, names: list[str], schemas: list[tuple[str, dict]],
                       answers: dict[str, dict], args: argparse.Namespace) -> dict:
    """Every library's numbers at one vocabulary (module docstring)."""
    lg = Llguidance(text, vocab_size)
    grammars = [lg.compile(schema) for _, schema in schemas]
    paths = []
    for i, ((name, _), grammar) in enumerate(zip(schemas, grammars)):
        if name in answers:
            paths.append(valid_prefix(lg, grammar, answers[name]["ids"], args.tokens))
        else:
            paths.append(random_path(lg, grammar, args.tokens, np.random.default_rng(args.seed + i)))
    libraries, result = [lg], {"paths": {n: p for (n, _), p in zip(schemas, paths)}, "libraries": {}}
    if "xgrammar" in names:
        try:
            libraries.append(Xgrammar(text, vocab_size))
        except ImportError as exc:
            print(f"xgrammar not measured ({exc}); .venv/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi",
                  file=sys.stderr)
    walks = {}
    for lib in libraries:
        compiles = compile_times(lib, schemas, args.repeat)
        compiled = [lib.compile(schema) for _, schema in schemas]
        walks[lib.name] = [walk(lib, c, p, args.repeat, mask_words(vocab_size)) for c, p in zip(compiled, paths)]
        result["libraries"][lib.name] = {
            "prepare_s": lib.prepare_s, **compiles,
            "mask_us": summary([t for w in walks[lib.name] for t in w.mask_us]),
            "mask_us_by_schema": {n: statistics.fmean(w.mask_us) for (n, _), w in zip(schemas, walks[lib.name])},
            "advance_us": summary([t for w in walks[lib.name] for t in w.advance_us])}
    if "xgrammar" in walks:
        result.update(agreement(schemas, walks["llguidance"], walks["xgrammar"], special_ids(text), vocab_size))
    result["last_stage_us"] = last_stage_us([m for w in walks["llguidance"] for m in w.masks], vocab_size)
    result["draft_step"] = draft_step_us(lg, grammars, paths, args.repeat)
    return result


def library_table(results: dict, token_ms: dict[int, float]) -> str:
    """One row per vocabulary and library (markdown)."""
    rows = []
    for vocab, r in results.items():
        for name, lib in r["libraries"].items():
            first, again = list(lib["first_ms"].values()), list(lib["again_ms"].values())
            mask, advance = lib["mask_us"], lib["advance_us"]
            share = (mask["mean"] + advance["mean"]) / (token_ms[vocab] * 1e3)
            rows.append((f"{vocab:,}", name, f"{lib['prepare_s']:.2f}",
                         f"{statistics.median(first):.1f} / {max(first):.0f}", f"{statistics.median(again):.2f}",
                         f"{mask['mean']:.0f} / {mask['p50']:.0f} / {mask['p99']:.0f}", f"{advance['mean']:.0f}",
                         f"{r['same_mask']:.1%}" if "same_mask" in r else None, f"{share:.2%}"))
    return harness.table(("vocab", "library", "prepare s", "compile ms p50 / max", "again ms",
                          "mask µs mean / p50 / p99", "advance µs", "same mask", "share of a token"), rows, pad=True)


def fleet_table(results: dict, token_ms: dict[int, float]) -> str:
    """fleet's own path per token (llguidance's mask and advance, the last stage's unpack and masked top-k)."""
    rows = []
    for vocab, r in results.items():
        lib, last, step = r["libraries"]["llguidance"], r["last_stage_us"], r["draft_step"]
        total = lib["mask_us"]["mean"] + lib["advance_us"]["mean"] + last["unpack"] + last["topk64_extra"]
        rows.append((f"{vocab:,}", f"{lib['mask_us']['mean']:.0f}", f"{lib['advance_us']['mean']:.0f}",
                     f"{last['unpack']:.0f}", f"{last['topk1_extra']:.0f} / {last['topk64_extra']:.0f}",
                     f"{total:.0f}", f"{token_ms[vocab]:.1f}", f"{total / (token_ms[vocab] * 1e3):.2%}",
                     f"{step['loop_us']:.0f} / {step['batch_us']:.0f}"))
    return harness.table(("vocab", "fill µs", "consume µs", "unpack µs", "masked top-k extra µs k=1 / 64",
                          "total µs", "token ms", "share", f"{DRAFTS}-draft step µs loop / batch"), rows, pad=True)


def answers_table(answers: dict[str, dict]) -> str:
    """The running fleet's own report: mask time as a share of each answer's decode time."""
    rows = [a for a in answers.values() if a["share"] is not None]
    shares = [a["share"] for a in rows]
    per_mask = [a["mask_ms"] / a["masks"] * 1e3 for a in rows if a["masks"]]
    rate = statistics.median(a["decode_tokens_per_s"] for a in rows)
    return (f"fleet at the URL: {len(rows)} answers, {sum(a['tokens'] for a in rows)} tokens, "
            f"{sum(a['masks'] for a in rows)} masks; decode {rate:.1f} tok/s (median); "
            f"mask µs per mask median {statistics.median(per_mask):.0f}, max {max(per_mask):.0f}; "
            f"mask share of decode time median {statistics.median(shares):.2%}, max {max(shares):.2%}")


def token_times(text: str) -> dict[int, float]:
    """``49152=20,262144=100`` as {vocab: ms per token}."""
    return {int(k): float(v) for k, v in (item.split("=") for item in text.split(","))}


def main(argv: list[str] | None = None) -> int:
    """Both libraries at each vocabulary (module docstring); prints the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="49152,262144", help="vocabulary sizes (the first must be the demo's)")
    parser.add_argument("--libraries", default="llguidance,xgrammar")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="longest token path per grammar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-ms", default="49152=20,262144=100", type=token_times,
                        help="a token's time per vocabulary (ms); --url replaces the demo's with the fleet's")
    parser.add_argument("--url", help="a running demo fleet: its answers are the paths, its report the share")
    parser.add_argument("--tokenizer", type=Path, default=DEMO_TOKENIZER)
    parser.add_argument("--schemas", help="comma-separated names (default: all twenty-one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    schemas = grammars_under_test()
    if args.schemas:
        schemas = [s for s in schemas if s[0] in args.schemas.split(",")]
    answers = fleet_answers(args.url, schemas) if args.url else {}
    token_ms = dict(args.token_ms)
    if answers:
        rate = statistics.median(a["decode_tokens_per_s"] for a in answers.values() if a["decode_tokens_per_s"])
        token_ms[49152] = 1e3 / rate
    base, results = demo_tokenizer_json(args.tokenizer), {}
    for vocab in (int(v) for v in args.vocab.split(",")):
        text = base if vocab == 49152 else extend_vocabulary(base, vocab, args.seed)
        results[vocab] = measure_vocabulary(text, vocab, args.libraries.split(","), schemas, answers, args)
        print(f"{vocab} tokens done", file=sys.stderr, flush=True)
    lengths = [len(p) for r in results.values() for p in r["paths"].values()]
    print(f"\ngrammar bench: {len(schemas)} grammars, paths of {min(lengths)}-{max(lengths)} tokens "
          f"({'the fleet answers' if answers else 'random allowed tokens'}), {args.repeat} repeats, "
          f"nproc {os.cpu_count()}")
    print(library_table(results, token_ms))
    print("\nfleet path per token (llguidance):\n" + fleet_table(results, token_ms))
    for vocab, r in results.items():
        if r.get("differing"):
            print(f"{vocab}: xgrammar's masks differ from llguidance's somewhere on {', '.join(r['differing'])}; "
                  f"it allows special tokens at {r['special_allowed']:.0%} of positions; it refuses a token "
                  f"llguidance allowed on {r['refused'] or 'none'} (schema: position)")
    for vocab, r in results.items():
        for name, lib in r["libraries"].items():
            worst = sorted(lib["mask_us_by_schema"].items(), key=lambda kv: -kv[1])[:4]
            print(f"{vocab} {name}: slowest masks on " + ", ".join(f"{n} {t:,.0f} µs" for n, t in worst))
    if answers:
        print("\n" + answers_table(answers))
    harness.write_json(args.json, "grammar_bench", {"token_ms": token_ms, "repeat": args.repeat, "tokens": args.tokens,
                                                    "answers": answers, "results": {str(k): v for k, v in results.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
