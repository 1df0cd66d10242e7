"""The single-device reference the fleet is compared with: transformers in f32 (torch, ``use_cache``),
greedy, on the model's own HF folder. It shares no code with the builder or the fleet, so a bug in the
stateful KV path (past > 0, the physical-slot mask, logical positions, ``beam_idx``, chunked prefill)
cannot hide in both.

Builds store fp16 weights (compiler/export.py), so the reference's weights are rounded to fp16 and
back to f32 first: what is compared is the computation, not the storage format. Both sides compute in
f32 but sum in other orders (oneDNN vs OpenVINO's kernels), so their logits differ by up to ~1e-3 on
the demo model (measured: 7.2e-4 over 20 positions, logits of magnitude ~30); a greedy divergence is
accepted only where the reference's top two logits are within ``NEAR_TIE``; the reference is then fed the
fleet's tokens (teacher forcing) and the rest of the output compared with what it predicts from them, so a
near-tie never ends a comparison. Such near-ties are counted and bounded by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

NEAR_TIE = 3e-3  # logits: ~4x the largest torch-vs-OpenVINO f32 difference measured on the demo


class TransformersReference:
    """An HF model folder loaded by transformers in f32 with fp16-rounded weights (``round_to_fp16``; off
    for builds that keep the source's values, such as a GGUF's blocks), for greedy decoding."""

    def __init__(self, hf_dir: Path, round_to_fp16: bool = True) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in self.model.parameters() if round_to_fp16 else ():
                p.copy_(p.half().float())

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (no early stop at end-of-sequence)."""
        return self.greedy_with_margins(prompt_ids, max_new_tokens)[0]

    def greedy_with_margins(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy continuation and, per token, the gap between the top two logits (how near a tie). Decodes on
        one torch thread (the calling thread's setting, restored after): as fast as two on an idle 2-core
        machine (48 tokens in 2.8 s either way), several times faster beside a busy process, where two threads
        wait on each other for a core (18.3 s against 4.3 s, measured)."""
        torch = self.torch
        ids = torch.tensor([prompt_ids], dtype=torch.int64)
        out, margins, past = [], [], None
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    result = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                    past = result.past_key_values
                    logits = result.logits[0, -1].numpy()
                    token = int(logits.argmax())
                    top2 = np.partition(logits, -2)[-2:]
                    margins.append(float(abs(top2[1] - top2[0])))
                    out.append(token)
                    ids = torch.tensor([[token]], dtype=torch.int64)
        finally:
            torch.set_num_threads(threads)
        return out, margins


    def forced_with_margins(self, prompt_ids: list[int], got: list[int]) -> tuple[list[int], list[float]]:
        """Teacher forcing: per position ``i`` of ``got``, the reference's greedy token after ``prompt_ids +
        got[:i]`` (one forward pass, no cache) and the gap between its top two logits."""
        torch = self.torch
        ids = torch.tensor([prompt_ids + got[:-1]], dtype=torch.int64)
        with torch.no_grad():
            logits = self.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:].numpy()
        top2 = np.partition(logits, -2, axis=-1)[:, -2:]
        return logits.argmax(-1).tolist(), np.abs(top2[:, 1] - top2[:, 0]).tolist()


def near_ties(got: list[int], tokens: list[int], margins: list[float], what: str,
              forced: Callable[[list[int]], tuple[list[int], list[float]]]) -> int:
    """How many times ``got`` left the reference, each at a near-tie (else the test fails): 0 if it equals
    the reference's greedy ``tokens`` (``margins``: their top-two gaps). After the first divergence the
    rest is compared with ``forced(got)`` (the reference teacher-forced on ``got``, e.g. a bound
    ``TransformersReference.forced_with_margins``): every other token where they differ must be a near-tie
    of it too, and counts."""
    if got == tokens:
        return 0
    first = next((j for j in range(min(len(got), len(tokens))) if got[j] != tokens[j]), min(len(got), len(tokens)))
    assert first < len(tokens), f"{what}: output longer than the reference ({len(got)} > {len(tokens)} tokens)"
    assert first < len(got), f"{what}: output stopped after {len(got)} of {len(tokens)} tokens"
    assert margins[first] < NEAR_TIE, (f"{what} diverged at token {first} ({got[first]} vs {tokens[first]}), where the "
                                       f"reference's top-two logits are {margins[first]:.2e} apart (not a near-tie)")
    want, gaps = forced(got)
    later = [j for j in range(first + 1, len(got)) if got[j] != want[j]]
    for j in later:
        assert gaps[j] < NEAR_TIE, (f"{what}: after a near-tie at token {first}, token {j} is {got[j]} where the "
                                    f"reference fed the same tokens says {want[j]} ({gaps[j]:.2e} apart, not a "
                                    f"near-tie)")
    return 1 + len(later)
