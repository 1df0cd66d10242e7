"""Single-device reference: greedy decoding of the whole-model (1-stage) IR in this process, f32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov

from fleet_common.manifest import load_manifest


class WholeModel:
    """The unsharded model compiled once on CPU with f32 inference and f32 KV (design.md §4)."""

    def __init__(self, build: Path) -> None:
        loaded = load_manifest(build)
        assert loaded.manifest.num_stages == 1
        self.compiled = ov.Core().compile_model(
            str(build / loaded.manifest.stages[0].xml), "CPU",
            {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": 1})

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (no early stop at end-of-sequence)."""
        return self.greedy_with_margins(prompt_ids, max_new_tokens)[0]

    def greedy_with_margins(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy continuation and, per token, the gap between the top two logits (how near a tie)."""
        request = self.compiled.create_infer_request()
        ids, out, margins, past = np.asarray([prompt_ids], dtype=np.int64), [], [], 0
        for _ in range(max_new_tokens):
            seq = ids.shape[1]
            logits = request.infer({
                "input_ids": ids,
                "attention_mask": np.ones((1, past + seq), dtype=np.int64),
                "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
                "logits_index": np.array([seq - 1], dtype=np.int64),
            })[0]
            token = int(logits[0, -1].argmax())
            top2 = np.partition(logits[0, -1], -2)[-2:]
            margins.append(float(abs(top2[1] - top2[0])))
            out.append(token)
            past += seq
            ids = np.array([[token]], dtype=np.int64)
        return out, margins
