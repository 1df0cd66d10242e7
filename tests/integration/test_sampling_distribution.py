"""Speculative sampling through a real fleet keeps the target's distribution (docs/speculative.md: "lossless for
sampling").

A tiny random Llama with the demo tokenizer's 49,152-token vocabulary (so the last stage returns its
top ``sample_top_k`` = 64 candidates, not the vocabulary) is built into 2 stages by ``fleet-compiler
build`` with a model draft: a second tiny model, the target with every weight perturbed (acceptance
~0.37 here, so acceptance, rejection and the residual all happen often). Real workers (f32) and a real
coordinator (``--draft draft --spec-k 2``, batch groups on) serve it over gRPC and HTTP; ``/v1/completions``
requests with seeds 0..N-1 at temperature 0.7 and top_p 0.9 each emit 4 tokens of one prompt: t1 from
the prefill's candidates (plain sampling), t2-t4 from the first verify step of 2 drafts (t4 is the bonus
token after both were accepted) or from the steps after a rejection. The marginals of t2, t3 and t4
and the bonus token's distribution (by its rank in the target's distribution at its context) are
compared by chi-square tests with the target's exact distribution, computed here by transformers in
f32 (independent of the fleet's code): log-softmax over the vocabulary, the 64 best, softmax of them at
the temperature, cut to the smallest prefix of mass >= top_p.

The same workers behind a coordinator process whose verification is broken on purpose (a rejected draft
resampled from p instead of max(0, p - q)) must fail the same tests. Measured on the loaded 2-core
machine (p-values of t2 / t3 / t4 / bonus, 400 samples each): lossless 0.6 / 0.34 / 0.63 / 0.91; broken
1.5e-08 / 0.0012 / 0.0049 / 0.91 (the bonus token does not depend on the residual); ~17 requests/s at a
load average of ~3, ~10 at ~13.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator.settings import CoordinatorSettings
from tests.conftest import BIN, Proc, start_coordinator, start_worker, wait_ready
from tests.integration.test_architectures import TOKENIZER, reference_model

pytestmark = pytest.mark.integration

VOCAB = 49152  # the demo tokenizer's
TOP_K = CoordinatorSettings.model_fields["sample_top_k"].default  # candidates the last stage returns: 64
TEMPERATURE, TOP_P, SPEC_K = 0.7, 0.9, 2
# After PROMPT the target's first token is nearly certain (0.976 >= top_p at T = 0.7: a one-token nucleus),
# so t1 = 367 always and t2-t4 are tested after one context, where the noncentrality of the broken
# control is highest (found by a search over 2,000 random 8-token prompts, numpy seed 0). There the
# candidates past the 64 best hold 26% of t2's mass (T = 0.7): the top-k cut changes the distribution.
PROMPT = [32982, 22811, 20508, 25381, 829, 2382, 7553, 36551]
NEW_TOKENS = 4  # t1 (prefill), t2 t3 (drafts or residuals), t4 (the bonus after 2 accepted drafts, or later)
# requests (seeds) per case, the same in both: the broken control shows the power of the test as run. At
# 400 the broken control's expected noncentrality at t2 alone is ~0.17 x 400 ~ 70, so about 1 in 50 seed
# schemes (a change to how the engine seeds its draws) would leave it above ALPHA: then raise SAMPLES. A
# correct fleet fails with probability ~4 x ALPHA per seed scheme.
# Under a grammar (no broken control: the power is shown above) 240: each request's masks cost the coordinator
# more than its tokens (that case used 73 of the file's 149 CPU seconds at 400 in a loaded rehearsal).
SAMPLES = {"lossless": 400, "broken": 400, "grammar": 240}
CLIENTS = 16  # concurrent requests: batch groups of up to 8 rows (--max-batch), drafting in turn
HEAD_SCALE = 20.0  # LM head x20: after most contexts the nucleus holds 20-40 tokens at T = 0.7
DRAFT_NOISE = 0.2  # draft = target + N(0, (0.2 std(w))^2) per weight
ALPHA = 1e-3  # each of the 4 tests (t2-t4, bonus): seeds are fixed, so the outcome is deterministic
# A coordinator process whose verification is broken on purpose: a rejected draft is resampled from the
# target's p (without the rejected token), not from max(0, p - q). (Resampling p with the rejected token
# in it, the textbook mistake, can emit the rejected draft again, which the draft model's bookkeeping
# takes for an accepted draft: its next proposal fails with a ValueError, so that control would fail
# the test by a crash, not by the distribution.)
BROKEN_COORDINATOR = """
import sys
import coordinator.engine.output
from coordinator.cli import main
from coordinator.engine.sampling import SparseDist

def verify(draft_tokens, draft_dists, target_dists, rngs):
    out = []
    for token, q, p, rng in zip(draft_tokens, draft_dists, target_dists, rngs):
        if q.prob(token) > 0 and rng.random() < min(1.0, p.prob(token) / q.prob(token)):
            out.append(int(token))
            continue
        keep = p.ids != token
        out.append(SparseDist(p.ids[keep], p.probs[keep] / p.probs[keep].sum()).sample(rng))
        return out
    return out + [target_dists[-1].sample(rngs[-1])]

coordinator.engine.output.verify = verify
sys.exit(main())
"""


def tiny_models(folder: Path, demo_hf: Path) -> tuple[Path, Path]:
    """The target (seed 0, LM head scaled by HEAD_SCALE) and its draft (the same weights, each perturbed by
    DRAFT_NOISE of its tensor's std), saved as f32 safetensors beside the demo's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    out = []
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
        for name in ("target", "draft"):
            if name == "draft":
                noise = torch.Generator().manual_seed(5)
                for p in model.parameters():
                    p.add_(DRAFT_NOISE * p.std() * torch.randn(p.shape, generator=noise))
            model.save_pretrained(folder / name)
            for file in TOKENIZER:
                shutil.copy(demo_hf / file, folder / name / file)
            out.append(folder / name)
    return out[0], out[1]


# The grammar case: a JSON string of 80-400 lowercase letters. Its first token opens the string ('"' and maybe
# letters); every later token of the first four is letters only (four tokens cannot reach 80 letters, so the
# closing quote is never allowed), so the allowed set depends only on the position: the reference computes it
# from the vocabulary's own bytes, not from the grammar library the fleet uses.
GRAMMAR = {"type": "string", "pattern": "^[a-z]{80,400}$"}


def grammar_allowed(tokenizer_json: Path) -> list[np.ndarray]:
    """The tokens GRAMMAR allows [2][V] bool: at the first position, then at the second to fourth."""
    import re

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(VOCAB)]
    special = {t for t in range(VOCAB) if tokenizer.id_to_token(t) in tokenizer.get_added_tokens_decoder().values()
               or t in tokenizer.get_added_tokens_decoder()}
    first = np.array([t not in special and re.fullmatch(r'"[a-z]*', x) is not None for t, x in enumerate(texts)])
    later = np.array([t not in special and re.fullmatch(r"[a-z]+", x) is not None for t, x in enumerate(texts)])
    return [first, later]


class ExactTarget:
    """The target's sampling distribution, by transformers in f32 on the weights the build stores (fp16);
    with ``allowed`` ([first position's, later positions'] allowed tokens [V] bool), under a grammar: the
    other tokens' logits -inf before the log-softmax and top-k, as the last stage masks them."""

    def __init__(self, src: Path, allowed: list[np.ndarray] | None = None) -> None:
        self.model, self.source = reference_model(src), src
        self.allowed = allowed

    def dists(self, contexts: np.ndarray, chunk: int = 512) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each row of ``contexts`` [B, L] int64: (ids [n], probs [n] float64) of the next token."""
        import torch

        out = []
        with torch.no_grad():
            for start in range(0, len(contexts), chunk):
                x = torch.from_numpy(contexts[start:start + chunk])
                logits = self.model(x, logits_to_keep=1).logits[:, -1]  # [b, V] f32
                if self.allowed is not None:
                    mask = self.allowed[min(contexts.shape[1] - len(PROMPT), 1)]
                    logits = logits.masked_fill(~torch.from_numpy(mask), float("-inf"))
                top = torch.topk(torch.log_softmax(logits, -1), TOP_K)  # the last stage's candidates
                probs = torch.softmax(top.values.double() / TEMPERATURE, -1)  # [b, TOP_K]
                keep = (torch.cumsum(probs, -1) < TOP_P).sum(-1) + 1  # smallest prefix of mass >= top_p
                for ids, p, n in zip(top.indices.numpy(), probs.numpy(), keep.tolist()):
                    out.append((ids[:n], p[:n] / p[:n].sum()))
        return out

    def marginals(self, depth: int, floor: float = 1e-7) -> tuple[list[np.ndarray], float]:
        """Exact marginals [depth][V] of the first ``depth`` tokens after PROMPT, summed over every path of
        probability > ``floor``; and the mass of the paths left out (a bound on each marginal's error)."""
        level: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
        marginals, lost = [], 0.0
        for d in range(depth):
            contexts = np.array([[*PROMPT, *path] for path, _ in level], dtype=np.int64)
            m, deeper = np.zeros(VOCAB), []
            for (path, w), (ids, probs) in zip(level, self.dists(contexts)):
                np.add.at(m, ids, w * probs)
                if d + 1 < depth:
                    for t, p in zip(ids.tolist(), (w * probs).tolist()):
                        if p > floor:
                            deeper.append(((*path, t), p))
                        else:
                            lost += p
            marginals.append(m)
            level = deeper
        return marginals, lost


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    """Pearson's statistic of observed ``counts`` [C] against ``expected`` [C] counts (same total), cells
    under 5 expected pooled into one; its degrees of freedom and p-value (chi-square upper tail). A count
    where nothing is expected (a token the target never samples there) gives p = 0."""
    import torch

    if counts[expected <= 0].any():
        return float("inf"), 0, 0.0
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if dof > 0 else 1.0
    return stat, dof, p


def rank_test(tokens: np.ndarray, dists: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, float]:
    """``chi_square`` of tokens [n], each drawn from its own distribution ``dists[i]`` (ids best first,
    probs), by the rank each token has in its distribution (cell TOP_K: outside its nucleus)."""
    counts, expected = np.zeros(TOP_K + 1), np.zeros(TOP_K + 1)
    for token, (ids, probs) in zip(tokens.tolist(), dists):
        hit = np.flatnonzero(ids == token)
        counts[hit[0] if hit.size else TOP_K] += 1
        expected[:len(probs)] += probs
    return chi_square(counts, expected)


def sample_fleet(url: str, samples: int, grammar: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """The fleet's tokens [samples, NEW_TOKENS] for seeds 0..samples-1 (under GRAMMAR with ``grammar``),
    whether t4 was the bonus token of the first verify step (both drafts accepted) [samples] bool, and the
    acceptance rate over all."""
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": TEMPERATURE,
            "top_p": TOP_P}
    if grammar:  # on the legacy completions a fleet extension, as in vLLM
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "letters", "schema": GRAMMAR}}

    def one(seed: int) -> dict:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{url}/v1/completions", json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        return r.json()["fleet"]

    with ThreadPoolExecutor(CLIENTS) as pool:
        fleet = list(pool.map(one, range(samples)))
    assert fleet[0]["sampling"]["top_k"] == 0 and fleet[0]["sampling"]["temperature"] == TEMPERATURE, fleet[0]
    tokens = np.array([f["completion_token_ids"] for f in fleet], dtype=np.int64)
    bonus = np.array([f["verify_steps"] >= 1 and f["accepted_tokens"] == SPEC_K and f["drafted_tokens"] == SPEC_K
                      for f in fleet])  # one verify step of 2 drafts, both accepted: t4 was its bonus token
    acceptance = sum(f["accepted_tokens"] for f in fleet) / sum(f["drafted_tokens"] for f in fleet)
    return tokens, bonus, acceptance


@pytest.fixture(scope="module")
def tiny_fleet(tmp_path_factory, demo_hf):  # noqa: ANN201 - a tuple
    """(the 2-stage build with its model draft, the addresses of two f32 workers serving it, the exact
    target, its exact marginals of the first NEW_TOKENS tokens, the folder for logs)."""
    tmp = tmp_path_factory.mktemp("sampling")
    target, draft = tiny_models(tmp, demo_hf)
    build = tmp / "build"
    out = subprocess.run([str(BIN / "fleet-compiler"), "build", str(target), "--out", str(build), "--shards", "2",
                          "--draft", str(draft)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    exact = ExactTarget(target)
    t0 = time.monotonic()
    marginals, lost = exact.marginals(NEW_TOKENS)
    print(f"exact marginals of {NEW_TOKENS} tokens in {time.monotonic() - t0:.1f} s (paths left out: {lost:.2g})")
    assert lost < 1e-4, lost
    workers = [start_worker(build, shard, tmp, "--no-announce") for shard in (0, 1)]
    try:
        yield build, [address for _, address in workers], exact, marginals, tmp
    finally:
        for proc, _ in workers:
            proc.stop()


def serve(build: Path, addresses: list[str], log_dir: Path, broken: bool) -> tuple[Proc, str]:
    """A coordinator over the workers at ``addresses`` drafting with the build's model draft, K = 2."""
    from coordinator.fleet.local import free_port

    args = ["--no-discover", *(a for address in addresses for a in ("--peer", address)), "--draft", "draft",
            "--spec-k", str(SPEC_K), "--inference-precision", "f32", "--no-prefix-cache"]
    if not broken:
        return start_coordinator(build, log_dir, *args)
    port = free_port()
    proc = Proc([sys.executable, "-c", BROKEN_COORDINATOR, "serve", "--model", str(build), "--port", str(port),
                 "--no-announce", *args], log_dir / "coordinator-broken.log")
    proc.wait_for(r"chat page: ")
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("case", ["lossless", "broken", "grammar"],
                         ids=["lossless", "broken-residual-caught", "lossless-under-a-grammar"])
def test_speculative_sampling_through_the_fleet_matches_transformers(tiny_fleet, case):
    """Under a grammar the target is the masked distribution (transformers' logits with the refused tokens at
    -inf): the drafts are drawn and verified under the same masks, so speculation stays lossless there too."""
    build, addresses, target, marginals, log_dir = tiny_fleet
    broken, samples, grammar = case == "broken", SAMPLES[case], case == "grammar"
    if grammar:
        target = ExactTarget(target.source, grammar_allowed(build / "tokenizer.json"))
        marginals, lost = target.marginals(NEW_TOKENS)
        assert lost < 1e-4, lost
    coordinator, url = serve(build, addresses, log_dir, broken)
    try:
        wait_ready(url)
        t0 = time.monotonic()
        tokens, bonus, acceptance = sample_fleet(url, samples, grammar)
        elapsed = time.monotonic() - t0
    finally:
        coordinator.stop()
    first = int(marginals[0].argmax())
    if grammar:  # the string opens and goes on in letters, as the reference's own allowed sets say
        allowed = grammar_allowed(build / "tokenizer.json")
        assert allowed[0][tokens[:, 0]].all() and allowed[1][tokens[:, 1:]].all()
    else:
        assert marginals[0][first] == 1.0 and (tokens[:, 0] == first).all(), np.unique(tokens[:, 0])  # 1-token nucleus
    results = {f"t{i + 1}": chi_square(np.bincount(tokens[:, i], minlength=VOCAB).astype(float), samples * m)
               for i, m in enumerate(marginals) if i > 0 or grammar}
    # the bonus token, given its context (t1-t3), is drawn from the target's next distribution there
    results["bonus"] = rank_test(tokens[bonus, 3], target.dists(
        np.array([[*PROMPT, *row[:3]] for row in tokens[bonus]], dtype=np.int64)))
    report = {name: f"chi2 {stat:.1f} dof {dof} p {p:.2g}" for name, (stat, dof, p) in results.items()}
    print(f"{case}: {samples} samples in {elapsed:.1f} s, acceptance {acceptance:.2f}, "
          f"{int(bonus.sum())} bonus tokens: {report}")
    assert 0.3 < acceptance < 0.9, acceptance  # drafts are accepted and rejected: both paths are exercised
    assert bonus.sum() > samples // 8, int(bonus.sum())  # ~0.2 of the requests: the bonus test has samples
    fits = all(p > ALPHA for _, _, p in results.values())
    if broken:
        assert not fits, f"a wrong residual went unnoticed: {report}"
    else:
        assert fits, f"speculative sampling drifted from the target: {report}"
