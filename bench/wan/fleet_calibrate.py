"""Calibration measurements of this machine for ``bench/wan/fleet_model.py``: per-stage and draft chunk
cost (``profile_stages``, ``profile_draft``: ``bench/wan/sweep.py`` runs both at its start), each
process's CPU per decode step (``measure_hop_cpu``) and fleet-wan's timer term
(``measure_link_timers``). The constants the model keeps from the last two are in its docstring;
re-measure with

    python bench/wan/fleet_calibrate.py link-timers          # a few seconds
    python bench/wan/fleet_calibrate.py hop-cpu BUILD        # a 2-stage build; about a minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.wan import fleet_sim

DRAFT_SEQS = (*range(1, 10), 16, 24, 32, 48)  # a draft feeds 1 token, or the ones it missed while adaptive K
# decoded plainly, or (prefill) the prompt: the sweep's prompts are 40 and 46 tokens


def profile_stages(build: Path, seqs: range = range(1, 10), context: int = 64, repeats: int = 15) -> dict:
    """Median ms of one chunk of ``seq`` tokens (one row) per stage of ``build``, one inference thread,
    in this process: {"stage_ms": [[ms per seq] per stage], "seqs": [...]}."""
    from fleet_common.manifest import load_manifest

    loaded = load_manifest(build)
    hidden = loaded.manifest.architecture.hidden_size
    return {"seqs": list(seqs),
            "stage_ms": [_chunk_ms(loaded.directory / e.xml, seqs, context, repeats, hidden, every_logit=True)
                         for e in loaded.manifest.stages]}


def profile_draft(build: Path, draft: str, context: int = 64, repeats: int = 15) -> dict:
    """Median ms of one chunk of each of ``DRAFT_SEQS`` tokens through ``build``'s draft model ``draft``
    (e.g. "self-int8"), one inference thread, logits of the last position only (as the coordinator
    feeds it): {"draft_ms": [ms per seq], "draft_seqs": DRAFT_SEQS}. Raises ``ManifestError`` for a
    draft the build does not have."""
    from fleet_common.manifest import load_manifest

    loaded = load_manifest(build)
    xml = loaded.directory / loaded.manifest.draft(draft).xml
    return {"draft_seqs": list(DRAFT_SEQS),
            "draft_ms": _chunk_ms(xml, DRAFT_SEQS, context, repeats, 0, every_logit=False)}


def _chunk_ms(xml: Path, seqs, context: int, repeats: int, hidden_size: int,  # noqa: ANN001
              every_logit: bool) -> list[float]:
    """Median ms per chunk of each of ``seqs`` tokens after ``context`` tokens of KV (fresh state each time);
    logits of every chunk position (a last stage verifying drafts) or of the last only (a draft feeding)."""
    import time

    import numpy as np

    from fleet_common.runtime import compile_ir

    compiled, _, _ = compile_ir(xml, "CPU", 1)
    request = compiled.create_infer_request()
    names = {p.get_any_name() for p in compiled.inputs}
    first = "input_ids" in names
    timings = []
    for seq in seqs:
        samples = []
        for _ in range(repeats):
            request.reset_state()
            x0 = (np.arange(context + seq, dtype=np.int64)[None] % 1000 if first
                  else np.zeros((1, context + seq, hidden_size), np.float32))
            feed = {("input_ids" if first else "hidden_states"): x0[:, :context],
                    "attention_mask": np.ones((1, context), np.int64),
                    "position_ids": np.arange(context)[None], "beam_idx": np.zeros(1, np.int32)}
            if "logits_index" in names:
                feed["logits_index"] = np.array([context - 1])
            request.infer(feed)
            feed = {("input_ids" if first else "hidden_states"): x0[:, context:],
                    "attention_mask": np.ones((1, context + seq), np.int64),
                    "position_ids": np.arange(context, context + seq)[None], "beam_idx": np.zeros(1, np.int32)}
            if "logits_index" in names:
                feed["logits_index"] = np.arange(seq) if every_logit else np.array([seq - 1])
            t0 = time.perf_counter()
            request.infer(feed)
            samples.append((time.perf_counter() - t0) * 1000)
        timings.append(sorted(samples)[len(samples) // 2])
    return timings


def measure_hop_cpu(build: Path, tokens: int = 48, runs: int = 3) -> dict:
    """CPU ms per decode step of each process of a 2-stage fleet of ``build`` behind fleet-wan links
    (1 Gbit/s, 0 ms), one user, no speculation: each worker's inference thread (its busiest) and the
    rest of it, the coordinator, the proxies and the client (this process). Medians over ``runs``."""
    import os

    import psutil

    from bench.clients import run_users, warm_up
    from bench.harness import Fleet
    from bench.wan.links import LinkProfile

    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "fleet-model-logs"
    logs.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {}
    with Fleet(build, logs, "--log-level", "WARNING", shards=[0, 1], worker_args=("--threads", "1"), pin=True,
               link=LinkProfile(rate_mbit=1000.0)) as fleet:
        procs = {**fleet.processes(), "this process": psutil.Process()}
        warm_up(fleet.url)
        link_threads = {link.thread_id for link in fleet.links}

        def cpu() -> dict[str, dict[int, float]]:
            return {name: {t.id: t.user_time + t.system_time for t in p.threads()} for name, p in procs.items()}

        for _ in range(runs):
            before = cpu()
            run_users(fleet.url, 1, tokens)
            for name, parts in hop_cpu_parts(before, cpu(), link_threads, tokens).items():
                for key, value in parts.items():
                    samples.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in samples.items()}


def hop_cpu_parts(before: dict, after: dict, link_threads: set[int], tokens: int) -> dict[str, dict[str, float]]:
    """CPU ms per token between two samples of every process's threads ({name: {thread id: seconds}}): a
    worker's busiest thread (inference) and the rest, the proxies' threads and the rest of this process
    (the client), the coordinator whole."""
    out = {}
    for name, threads in after.items():
        spent = {tid: (t - before[name].get(tid, 0.0)) * 1000 / tokens for tid, t in threads.items()}
        if name.startswith("worker"):
            busiest = max(spent.values())
            out[name] = {f"{name} inference": busiest, f"{name} other": sum(spent.values()) - busiest}
        elif name == "this process":
            proxies = sum(v for tid, v in spent.items() if tid in link_threads)
            out[name] = {"proxies": proxies, "client": sum(spent.values()) - proxies}
        else:
            out[name] = {name: sum(spent.values())}
    return out


def measure_link_timers(sizes: tuple[int, ...] = (100, 1200, 2400, 4000), round_trips: int = 60) -> list[dict]:
    """Median round trip (ms) of messages through one fleet-wan link to an echo server on loopback, per
    (rate, delay) and message size: the fleet-wan timer term (two crossings per round trip)."""
    import socket
    import socketserver
    import threading
    import time

    from bench.wan.links import LinkProfile, WanLink

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = []
    try:
        for rate, delay in ((0.0, 0.0), (1000.0, 0.0), (20.0, 0.0), (1000.0, 10.0), (20.0, 10.0)):
            link = WanLink(f"127.0.0.1:{server.server_address[1]}", LinkProfile(delay_ms=delay, rate_mbit=rate)).start()
            try:
                for size in sizes:
                    with socket.create_connection((link.listen_host, link.listen_port), timeout=10) as sock:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        times = []
                        for _ in range(round_trips):
                            t0 = time.perf_counter()
                            sock.sendall(b"x" * size)
                            got = 0
                            while got < size:
                                got += len(sock.recv(1 << 16))
                            times.append((time.perf_counter() - t0) * 1000)
                    modelled = 2 * fleet_sim.timer_release((size * 8 / (rate * 1e3) if rate else 0.0) + delay, delay)
                    rows.append({"rate_mbit": rate, "delay_ms": delay, "bytes": size,
                                 "round_trip_ms": statistics.median(times), "timer_model_ms": modelled})
            finally:
                link.stop()
    finally:
        server.shutdown()
        server.server_close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """``link-timers`` or ``hop-cpu BUILD`` (module docstring); prints the measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("link-timers", help="fleet-wan's timer term: an echo server behind one link (a few seconds)")
    p = sub.add_parser("hop-cpu", help="each process's CPU per decode step of a 2-stage fleet behind fleet-wan links "
                       "(starts 2 workers and a coordinator; about a minute)")
    p.add_argument("build", type=Path, help="a 2-stage build folder")
    args = parser.parse_args(argv)
    if args.what == "hop-cpu":
        for key, ms in measure_hop_cpu(args.build).items():
            print(f"{key:<20} {ms:6.2f} CPU ms per decode step")
        return 0
    from bench.harness import table

    print(table(["Mbit/s", "ms", "bytes", "round trip ms", "model: timers ms"],
                [[f"{r['rate_mbit']:.0f}", f"{r['delay_ms']:.0f}", r["bytes"], f"{r['round_trip_ms']:.2f}",
                  f"{r['timer_model_ms']:.2f}"] for r in measure_link_timers()], pad=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
