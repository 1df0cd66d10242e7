"""What an empty worker announces it can hold and how fast it runs (issue 30): the memory available, its
device, and a speed figure, ``ms_per_gb``.

A worker with no model cannot time a decoder layer as ``fleet-worker --profile`` does, so it times what a
decode step is made of: a MatMul of one token's activations [1, ``K``] f32 by a weight matrix [``K``, ``N``]
stored as f16 (``SYNTHETIC_BYTES``, larger than a CPU's caches, so it reads from memory as a real layer's
weights do; the CPU plugin keeps f16 constants compressed and decompresses them in the kernel, as for an
fp16 build). ``ms_per_gb`` is the fastest time of one such MatMul over ``STEPS`` runs, per GB (1e9 bytes) of
its weights: the fastest, not the median, because another process on the PC (another worker starting, a
build) only ever adds time; on this 2-core machine, two workers measuring at once moved the median of 10
runs 2-2.7x and the fastest of 50 1.3-1.5x (the planner then treats speeds within 20% as equal). The planner (compiler/planner.py), whose cost model is weight reads per token, scales it to a
stage: ``ms_per_layer = ms_per_gb * (bytes of one layer's weights) / 1e9`` (``ms_per_layer``). It ignores
attention over the KV cache and the stage's fixed costs, as the planner's model does.

The figure is measured once per machine, device, thread count and OpenVINO version and cached in
``<stages dir>/speed.json``; a restarted worker reads it back (``measured_speed``).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path

import numpy as np
import psutil

from fleet_common.discovery import Capacity, implausible

log = logging.getLogger(__name__)

K, N = 4096, 4096  # the weight matrix: 16 Mi values, 32 MiB at f16
SYNTHETIC_BYTES = K * N * 2
WARMUP, STEPS = 2, 50  # one MatMul takes 1-4 ms
SPEED_FILE = "speed.json"


def ms_per_layer(ms_per_gb: float, layer_weight_bytes: int) -> float:
    """The planner's ``ms_per_layer`` for a layer of ``layer_weight_bytes`` bytes of weights on a worker whose
    speed is ``ms_per_gb``."""
    return ms_per_gb * layer_weight_bytes / 1e9


def time_synthetic_matmul(device: str = "CPU", threads: int = 0) -> float:
    """``ms_per_gb`` (module doc) measured now on ``device`` with ``threads`` inference threads (0: OpenVINO's
    default). Takes about a second (mostly compiling). Raises ``RuntimeError`` when the device cannot compile the MatMul."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([1, K], ov.Type.f32, name="x")
    w = ops.convert(ops.constant(rng.standard_normal((K, N), dtype=np.float32).astype(np.float16)), ov.Type.f32)
    model = ov.Model([ops.matmul(x, w, False, False)], [x], "fleet_speed_probe")
    config = {"INFERENCE_NUM_THREADS": threads} if threads else {}
    compiled = ov.Core().compile_model(model, device, config)
    request = compiled.create_infer_request()
    feed = {0: rng.standard_normal((1, K), dtype=np.float32)}
    times = []
    for step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        request.infer(feed)
        if step >= WARMUP:
            times.append((time.perf_counter() - t0) * 1000)
    return min(times) / (SYNTHETIC_BYTES / 1e9)


def speed_key(device: str, threads: int) -> str:
    """speed.json's key of a figure: this machine, its processor, ``device``, ``threads`` and the OpenVINO version."""
    import openvino as ov

    return f"{platform.node()}|{platform.processor() or platform.machine()}|{device}|{threads}|{ov.get_version()}"


def measured_speed(cache_dir: Path | None, device: str = "CPU", threads: int = 0) -> Capacity:
    """This worker's capacity: its speed read from ``cache_dir/speed.json`` when measured there before for
    this machine, device, threads and OpenVINO version, else measured (``time_synthetic_matmul``) and
    written there (None: not cached). An unreadable cache file (not JSON, not an object, no figure) or an
    implausible figure (NaN, negative, 1e-300: ``fleet_common.discovery.implausible``) is measured over, never an
    error."""
    memory = psutil.virtual_memory().available
    key = speed_key(device, threads)
    path = Path(cache_dir) / SPEED_FILE if cache_dir is not None else None
    known: dict = {}
    if path is not None and path.is_file():
        try:
            known = json.loads(path.read_text())
            if not isinstance(known, dict):
                raise TypeError(f"a JSON {type(known).__name__}, not an object")
            if key in known:
                cached = Capacity(memory, device, float(known[key]["ms_per_gb"]), cached=True)
                if (odd := implausible(cached)) is None:
                    return cached
                log.warning("speed cache %s gives %s: measuring again", path, odd)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("speed cache %s unreadable (%r): measuring again", path, exc)
            known = {}
    capacity = Capacity(memory, device, round(time_synthetic_matmul(device, threads), 4))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            known[key] = {"ms_per_gb": capacity.ms_per_gb}
            tmp = path.with_name(path.name + ".part")
            tmp.write_text(json.dumps(known, indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot cache the speed figure in %s: %s", path, exc)
    return capacity
