"""A SwiGLU model's calibrated sparse FFN build (``fleet-compiler build --sparse-ffn S``): the dense build of the same
weights first (beside ``-o``, removed after), its per-layer thresholds measured on a calibration text
(compiler/calibrate.py), the sparse build made with them, and its quality measured against the dense one
(compiler/quality.py: perplexity on the evaluation text's first ``QUALITY_TOKENS`` tokens, teacher-forced greedy
agreement on its prompts). A build that loses more than it is allowed is refused, saying what it measured; one
that keeps within states the measurement and the limits in its manifest (``SparseFfnEntry``). Light to import (the
CLI's defaults): OpenVINO is imported where it runs."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet_common.manifest import Manifest

    from .calibrate import Calibration

log = logging.getLogger(__name__)

MAX_PPL_INCREASE = 0.05  # the default loss a sparse build may take: perplexity at most 1.05x the dense build's
MIN_AGREEMENT = 0.85  # and at least this share of the dense build's greedy tokens ranked first
QUALITY_TOKENS = 1024  # evaluation-text tokens the build-time perplexity is measured on


@dataclasses.dataclass(frozen=True)
class Limits:
    """The loss a calibrated sparse build is held to (``--max-ppl-increase``, ``--min-agreement``)."""

    max_ppl_increase: float = MAX_PPL_INCREASE
    min_agreement: float = MIN_AGREEMENT

    def __post_init__(self) -> None:
        """``ValueError`` for a limit no build could be held to: not a finite perplexity increase >= 0, not an
        agreement in [0, 1]."""
        if not (math.isfinite(self.max_ppl_increase) and self.max_ppl_increase >= 0):
            raise ValueError(f"--max-ppl-increase {self.max_ppl_increase}: give the fraction perplexity may rise over "
                             "the dense build's, 0 or more (e.g. 0.05)")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"--min-agreement {self.min_agreement}: give the share of the dense build's greedy tokens "
                             "to keep, between 0 and 1 (e.g. 0.85)")


def calibrate_on_dense(build_dense: Callable[[Path], object], dense_dir: Path, sparsity: float,
                       text_file: Path | None) -> Calibration:
    """``build_dense(dense_dir)`` (the same model, layers and weights without the sparse FFN), then the thresholds
    for ``sparsity`` measured on it over the calibration text (``text_file``, or compiler/calibrate.py's default;
    read and checked first, so that a bad one fails before the dense build). ``CalibrationError`` for a text that
    cannot be read or is too short; the dense build's own errors as they are."""
    from .calibrate import calibrate, calibration_ids, calibration_text  # OpenVINO: not for fleet-compiler --help

    text = calibration_text(text_file)
    build_dense(dense_dir)
    ids = calibration_ids(dense_dir, text)
    calibration = calibrate(dense_dir, sparsity, ids, text)
    log.info("calibrated the sparse FFN at S = %g on %d tokens of %s", sparsity, len(ids), text.name)
    return calibration


def hold_to_limits(staging: Path, dense_dir: Path, calibration: Calibration, manifest: Manifest,
                   limits: Limits) -> Manifest:
    """Measure the sparse build in ``staging`` against ``dense_dir`` and write its ``SparseFfnEntry`` into
    ``staging``'s manifest (returned). ``BuildError`` naming the measurement and what to change when it loses more
    than ``limits`` allow."""
    from fleet_common.manifest import MANIFEST_NAME, SparseFfnEntry

    from .quality import compare
    from .save import BuildError

    _, c = compare(staging, dense_dir, tokens=QUALITY_TOKENS)
    (staging / "quality.json").unlink(missing_ok=True)  # the measurement's cache: not part of the build
    measured = (f"perplexity {c.ppl_increase:+.2%} against the dense build over {QUALITY_TOKENS} tokens, greedy "
                f"agreement {c.agreement:.3f}")
    if c.ppl_increase > limits.max_ppl_increase or c.agreement < limits.min_agreement:
        raise BuildError(f"--sparse-ffn {calibration.sparsity}: {measured}, past the stated loss (perplexity at most "
                         f"{limits.max_ppl_increase:+.1%}, agreement at least {limits.min_agreement}): skip fewer "
                         "neurons (a smaller --sparse-ffn), or allow more loss (--max-ppl-increase, --min-agreement)")
    log.info("sparse FFN at S = %g: %s", calibration.sparsity, measured)
    layers = manifest.architecture.num_layers
    entry = SparseFfnEntry(activation="silu", sparsity=calibration.sparsity,
                           thresholds=tuple(calibration.thresholds.get(i, 0.0) for i in range(layers)),
                           calibration=calibration.text.name, calibration_sha256=calibration.text.sha256,
                           calibration_tokens=calibration.tokens,
                           quality_tokens=QUALITY_TOKENS, ppl_increase=round(c.ppl_increase, 6),
                           agreement=round(c.agreement, 6), max_ppl_increase=limits.max_ppl_increase,
                           min_agreement=limits.min_agreement)
    manifest = dataclasses.replace(manifest, sparse_ffn=entry)
    (staging / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest
