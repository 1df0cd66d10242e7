"""``fleet-worker --profile``: how fast this PC runs a decoder layer and how much memory it has free, as a
node record for ``fleet-compiler plan --nodes``; it serves nothing.

It loads one stage of a build as a worker would (blob, model cache or IR; worker/loader.py), prefills
``CONTEXT`` tokens, then times ``STEPS`` single-token decode steps (after ``WARMUP``) and takes the
median inference time. Per layer is that / the stage's layers: the stage's own costs (embedding
lookup, masks, the call) are spread over its layers, so a stage of few layers reads a little slow.
A stage holding the LM head (a 1-stage build) also reads the head; the record says so (``lm_head``)
and the planner takes the head's share out (compiler/nodes.py). Free memory is what the OS reports
as available now (psutil); close what the PC will not run beside its worker first.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

from fleet_common.manifest import LoadedManifest, ManifestError, load_manifest
from fleet_common.runtime import KVSession

from .loader import default_cache_dir
from .runner import ShardRunner

log = logging.getLogger(__name__)

CONTEXT = 128  # tokens prefilled before timing (short: the planner's cost model is weight reads)
WARMUP = 3
STEPS = 16


@dataclass(frozen=True)
class Profile:
    """A node record: what ``fleet-compiler plan --nodes`` reads (compiler/nodes.py), and how it was measured."""

    name: str
    device: str
    device_name: str  # OpenVINO's FULL_DEVICE_NAME
    memory_bytes: int  # available memory when measured
    ms_per_layer: float  # median decode step / the stage's layers
    ms_per_token: float  # median decode step of the whole stage
    layers: int
    lm_head: bool  # the stage also ran the LM head (its time is in ms_per_token)
    stage: int
    context: int
    threads: int
    inference_precision: str
    weights: str  # the stage's weight format
    model_id: str

    def line(self) -> str:
        """One human line, ending with the ``--node`` spec the planner takes."""
        head = ", LM head included" if self.lm_head else ""
        return (f"{self.name}: {self.device} ({self.device_name}), threads {self.threads or 'default'}: "
                f"{self.ms_per_layer:.3f} ms per layer per token (stage {self.stage}: {self.layers} layers{head}, "
                f"{self.weights}, {self.ms_per_token:.2f} ms/token at {self.context} tokens); "
                f"{self.memory_bytes / (1 << 30):.1f} GiB available; "
                f"--node {self.name}:{self.memory_bytes >> 20}MiB:{self.ms_per_layer:.4f}ms:{self.device}")


def profile(loaded: LoadedManifest, stage: int = 0, device: str = "CPU", threads: int = 0,
            inference_precision: str = "auto", name: str | None = None, cache_dir: Path | None = None) -> Profile:
    """Time ``stage`` of the build on ``device`` (module doc). Raises ``ValueError`` for a stage the build
    lacks, ``RuntimeError`` when it does not compile on ``device``."""
    import openvino as ov

    runner = ShardRunner(loaded, stage, device, threads, inference_precision, cache_dir=cache_dir)
    manifest = loaded.manifest
    session = KVSession("profile", runner.new_request(), CONTEXT + WARMUP + STEPS)
    rng = np.random.default_rng(0)
    if runner.first:
        x = rng.integers(0, manifest.architecture.vocab_size, (1, CONTEXT), dtype=np.int64)  # [1, S]
    else:
        x = rng.standard_normal((1, CONTEXT, manifest.architecture.hidden_size), dtype=np.float32)  # [1, S, H]
    logits = 1 if runner.last else 0
    runner.run(session, x, 0, 0, [], logits)
    times = []
    for step in range(WARMUP + STEPS):
        result = runner.run(session, x[:, :1], session.length, session.length, [], logits)
        if step >= WARMUP:
            times.append(result.compute_ms)
    ms = statistics.median(times)
    entry = manifest.stages[stage]
    return Profile(name or socket.gethostname(), device, str(ov.Core().get_property(device, "FULL_DEVICE_NAME")),
                   psutil.virtual_memory().available, round(ms / entry.num_layers, 4), round(ms, 3),
                   entry.num_layers, runner.last, stage, CONTEXT, threads, inference_precision, entry.weights,
                   manifest.model_id)


def main(argv: list[str]) -> int:
    """``fleet-worker --profile ...``; prints the human line (stderr with --json) and with --json the record."""
    parser = argparse.ArgumentParser(prog="fleet-worker --profile",
                                     description="Time a decoder layer on this PC and report its available memory: "
                                                 "a node record for fleet-compiler plan. Serves nothing.")
    parser.add_argument("--profile", action="store_true", required=True)
    parser.add_argument("--model", type=Path, required=True, help="a build folder of the model (any split)")
    parser.add_argument("--shard", type=int, default=0, help="stage to time (default 0: it holds no LM head "
                                                             "unless the build has one stage)")
    parser.add_argument("--device", default="CPU", help="OpenVINO device: CPU, GPU, NPU")
    parser.add_argument("--threads", type=int, default=0, help="inference threads, as the worker will run (0: "
                                                               "OpenVINO's default)")
    parser.add_argument("--inference-precision", default="auto", choices=["auto", "f32", "bf16", "f16"])
    parser.add_argument("--name", help="node name in the record (default: this host's name)")
    parser.add_argument("--json", action="store_true", help="print the node record as one JSON line on stdout")
    parser.add_argument("--no-model-cache", dest="model_cache", action="store_false",
                        help="do not use OpenVINO's model cache (default ~/.cache/fleet/openvino)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s worker profile %(name)s: %(message)s")
    try:
        result = profile(load_manifest(args.model), args.shard, args.device.upper(), args.threads,
                         args.inference_precision, args.name, default_cache_dir() if args.model_cache else None)
    except (ManifestError, ValueError, RuntimeError) as exc:
        print(f"fleet-worker --profile: error: {exc}", file=sys.stderr)
        return 2
    print(result.line(), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(asdict(result)))
    return 0
