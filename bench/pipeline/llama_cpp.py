"""The fleet beside llama.cpp's RPC fleet on the same GGUF: ``bench/pipeline/interleave_bench.py --llama-cpp [--model FILE.gguf]``.

Both run one GGUF file split into the same 2 stages, one core each: the demo's
(``SmolLM2-135M-Instruct.Q4_1.gguf``), or ``--model FILE.gguf`` (it must be a GGUF: llama.cpp runs nothing else,
and the fleet is built from the same file; an HF folder or a fleet build is refused with a message):

* fleet: the GGUF built into 2 stages, its blocks kept (``fleet-compiler build FILE.gguf --shards 2`` into the
  cache, bench/models.py; for the demo the default split is 0:19 / 19:30 + LM head); one ``fleet-worker`` per
  stage pinned to core ``stage`` (``taskset``,
  ``--threads 1``), the coordinator unpinned, batch groups (the default).
* llama.cpp: one ``rpc-server -t 1`` per stage pinned the same way, and ``llama-server --rpc A,B -ngl 99
  --tensor-split 19,12 -t 1 -tb 1`` unpinned. ``-ngl 99`` puts every layer and the output on the RPC
  devices; llama.cpp splits ``n_layer + 1`` slots (the output is the last) by the cumulative
  ``--tensor-split`` (src/llama-model.cpp, ``load_tensors``), so 19,12 gives each rpc-server the layers
  of the fleet's stage. The token embedding stays in llama-server (llama.cpp keeps the input layer on
  the host). Continuous batching (its default), ``-np`` = the most users, ``-c`` 1024 per slot, prompt
  caching off (``cache_prompt: false``, ``--cache-ram 0``: the bench repeats its prompts; the fleet's
  prefix cache is off too, ``--no-prefix-cache``, where it has one), ``--fit off`` (no argument is
  changed behind our back).

Same prompts (``bench.clients.PROMPTS``), greedy, ``ignore_eos``, the same ``max_tokens``, streamed
through each server's ``/v1/chat/completions``; every answer must report exactly that many completion
tokens. Both systems stay up together and take turns (order alternating per repeat) so that the
machine's drifting load hits both alike; each cell is the median of ``--repeats`` runs and each
fleet ÷ llama.cpp the median of the repeats' paired ratios. Peak RSS is
each process's ``VmHWM`` (a sum of per-process peaks), read after the last cell.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import harness, models
from bench.clients import peak_rss_mib, run_users, warm_up
from coordinator.fleet.local import free_port

LLAMA_CPP_PYTHON = harness.LLAMA_CPP_PYTHON
DEFAULT_BIN = harness.LLAMA_CPP_BIN  # where bench/build_llama_cpp.sh puts llama-server and rpc-server
FLEET = "fleet"
RPC = "llama.cpp RPC"
SINGLE = "llama.cpp 1 process"
NO_PROMPT_CACHE = {"cache_prompt": False}
METRICS = (("aggregate_tok_s", "aggregate tok/s"), ("per_user_tok_s", "per-user tok/s"),
           ("ttft_ms", "TTFT ms"), ("cpu_ms_per_token", "CPU ms/token"))


@dataclass
class System:
    """One system under test: its URL, processes by name (``worker N``/``rpc-server N`` hold stages,
    ``coordinator``/``llama-server`` face the client) and extra request fields."""

    url: str
    procs: dict[str, psutil.Process]
    extra: dict | None = None

    def commands(self) -> dict[str, dict]:
        """Each process's command line and the cores it may run on."""
        return {name: {"cmdline": p.cmdline(), "cores": p.cpu_affinity()} for name, p in self.procs.items()}


def binaries(bin_dir: Path) -> tuple[Path, Path]:
    """(llama-server, rpc-server) in ``bin_dir`` (``ggml-rpc-server`` is rpc-server's newer name).
    Raises ``FileNotFoundError`` naming the folder and the script that builds them."""
    server = bin_dir / "llama-server"
    rpc = next((p for p in (bin_dir / "rpc-server", bin_dir / "ggml-rpc-server") if p.is_file()), None)
    if not server.is_file() or rpc is None:
        raise FileNotFoundError(f"no llama-server and rpc-server in {bin_dir}: run bench/build_llama_cpp.sh "
                                f"(about 5 minutes on 2 cores) or give --llama-cpp-bin DIR")
    return server, rpc


def tensor_split(stages: list[dict]) -> list[int]:
    """llama.cpp ``--tensor-split`` weights that put each fleet stage's decoder layers on its own RPC
    device. ``stages``: the manifest's stages (half-open ``[start, end)`` layer ranges, in order). llama.cpp
    splits ``n_layer + 1`` slots with the output last, so the last device gets one more. Raises
    ``ValueError`` if the ranges are not contiguous from layer 0."""
    expected = 0
    for stage in stages:
        if stage["start"] != expected or stage["end"] <= stage["start"]:
            raise ValueError(f"stages are not contiguous from layer 0: {[(s['start'], s['end']) for s in stages]}")
        expected = stage["end"]
    return [s["end"] - s["start"] + (i == len(stages) - 1) for i, s in enumerate(stages)]


def wait_port(port: int, proc: harness.Proc, timeout_s: float = 60.0) -> None:
    """Return once 127.0.0.1:``port`` accepts a connection; ``RuntimeError`` if ``proc`` exits first,
    ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited; log tail:\n{proc.text()[-2000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} not open after {timeout_s:.0f} s; see {proc.log}")


def server_command(server: Path, gguf: Path, port: int, slots: int, threads: int) -> list[str]:
    """llama-server's command line shared by both llama.cpp configurations (see the module docstring)."""
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * 1024), "--cont-batching", "--cache-ram", "0",
            "--fit", "off", "--no-webui"]


def start_rpc_fleet(bins: tuple[Path, Path], gguf: Path, split: list[int], slots: int, logs: Path,
                    stack: ExitStack) -> System:
    """One pinned ``rpc-server -t 1`` per entry of ``split`` and an unpinned llama-server offloading all
    layers to them; stopped when ``stack`` closes. Raises ``RuntimeError``/``TimeoutError`` if one
    exits or does not serve in time."""
    server, rpc = bins
    addresses, procs = [], {}
    for stage in range(len(split)):
        port = free_port()
        log = logs / f"llamacpp-rpc{stage}.log"
        cmd = harness.pinned(stage, [str(rpc), "-H", "127.0.0.1", "-p", str(port), "-t", "1"])
        procs[f"rpc-server {stage}"] = proc = harness.spawn(cmd, log, stack)
        wait_port(port, proc)
        addresses.append(f"127.0.0.1:{port}")
    port = free_port()
    log = logs / "llamacpp-rpc-llama-server.log"
    cmd = [*server_command(server, gguf, port, slots, 1), "--rpc", ",".join(addresses), "-ngl", "99",
           "--split-mode", "layer", "--tensor-split", ",".join(map(str, split))]
    procs["llama-server"] = proc = harness.spawn(cmd, log, stack)
    url = f"http://127.0.0.1:{port}"
    harness.wait_ready(url, 180.0, proc)
    warm_up(url, NO_PROMPT_CACHE)
    return System(url, {name: psutil.Process(p.pid) for name, p in procs.items()}, NO_PROMPT_CACHE)


def start_single(server: Path, gguf: Path, slots: int, logs: Path, stack: ExitStack) -> System:
    """One llama-server on both cores (``-t 2``, unpinned), the whole model in one process."""
    port = free_port()
    log = logs / "llamacpp-single-llama-server.log"
    cmd = server_command(server, gguf, port, slots, min(2, os.cpu_count() or 1))
    proc = harness.spawn(cmd, log, stack)
    url = f"http://127.0.0.1:{port}"
    harness.wait_ready(url, 180.0, proc)
    warm_up(url, NO_PROMPT_CACHE)
    return System(url, {"llama-server": psutil.Process(proc.pid)}, NO_PROMPT_CACHE)


def median_cell(runs: list[dict], tokens: int) -> dict:
    """One cell from repeated :func:`run_users` results: the median of each metric (CPU ms/token summed
    over the system's processes, the client left out), every run's numbers (``runs``, in repeat order,
    for paired ratios), the first run's answers.
    Raises ``RuntimeError`` if an answer does not report exactly ``tokens`` completion tokens."""
    for run in runs:
        for answer in run["answers"]:
            got = (answer["usage"] or {}).get("completion_tokens")
            if got != tokens:
                raise RuntimeError(f"an answer reported {got} completion tokens, not {tokens}: {answer}")
    cpu = [sum(ms for name, ms in r["cpu_ms_per_token"].items() if name != "client") for r in runs]
    keys = ("aggregate_tok_s", "per_user_tok_s", "ttft_ms")
    by_process = {name: statistics.median(r["cpu_ms_per_token"][name] for r in runs)
                  for name in runs[0]["cpu_ms_per_token"]}
    return {"users": runs[0]["users"], **{k: statistics.median(r[k] for r in runs) for k in keys},
            "cpu_ms_per_token": statistics.median(cpu), "cpu_ms_per_token_by_process": by_process,
            "runs": [{**{k: r[k] for k in (*keys, "wall_s")}, "cpu_ms_per_token": c} for r, c in zip(runs, cpu)],
            "prompt_tokens": [(a["usage"] or {}).get("prompt_tokens") for a in runs[0]["answers"]],
            "answers": [a["text"] for a in runs[0]["answers"]]}


def measure(systems: dict[str, System], users_list: list[int], tokens: int, repeats: int) -> dict[str, list[dict]]:
    """Each system's cells for each user count; the systems take turns, in alternating order."""
    cells: dict[str, list[dict]] = {name: [] for name in systems}
    for users in users_list:
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        for repeat in range(repeats):
            for name in (list(systems) if repeat % 2 == 0 else list(reversed(systems))):
                s = systems[name]
                runs[name].append(run_users(s.url, users, tokens, s.procs, s.extra))
        for name in systems:
            cell = median_cell(runs[name], tokens)
            cells[name].append(cell)
            print(f"  {name}, {users} users: {cell['aggregate_tok_s']:.1f} tok/s aggregate, "
                  f"{cell['per_user_tok_s']:.1f} per user, TTFT {cell['ttft_ms']:.0f} ms, "
                  f"{cell['cpu_ms_per_token']:.1f} CPU ms/token", flush=True)
    return cells


def paired_ratio(ours: dict, theirs: dict, key: str) -> float:
    """Median over repeats of ours ÷ theirs for ``key``, each repeat's two runs taken back to back (so
    a load burst on the machine hits both). Raises ``ValueError`` if the cells have different repeats."""
    if len(ours["runs"]) != len(theirs["runs"]):
        raise ValueError(f"{len(ours['runs'])} runs against {len(theirs['runs'])}: not paired")
    return statistics.median(a[key] / b[key] for a, b in zip(ours["runs"], theirs["runs"]))


def comparison_table(ours: list[dict], theirs: list[dict], name: str = "llama.cpp") -> list[str]:
    """Markdown rows: per user count and metric, ``fleet / theirs / ÷``: the medians and the median
    paired ratio fleet ÷ theirs (:func:`paired_ratio`; TTFT and CPU ms/token: lower is better).
    ``ours``/``theirs``: cells of :func:`median_cell`, same user counts and repeats. Raises
    ``ValueError`` if those differ."""
    if [c["users"] for c in ours] != [c["users"] for c in theirs]:
        raise ValueError(f"user counts differ: {[c['users'] for c in ours]} vs {[c['users'] for c in theirs]}")
    digits = {k: 0 if k == "ttft_ms" else 1 for k, _ in METRICS}
    rows = [[a["users"], *(f"{a[k]:.{digits[k]}f} / {b[k]:.{digits[k]}f} / {paired_ratio(a, b, k):.2f}"
                           for k, _ in METRICS)] for a, b in zip(ours, theirs)]
    return harness.table(["users", *(f"{label}: fleet / {name} / ÷" for _, label in METRICS)], rows).splitlines()


def memory_rows(fleet: dict[str, float], other: dict[str, float], name: str = "llama.cpp") -> list[str]:
    """Markdown rows of peak RSS (MiB): the processes holding stages (``worker``/``rpc-server``), the
    front (coordinator / llama-server) and all, fleet / ``name`` / ÷."""
    def part(peaks: dict[str, float], front: bool | None) -> float:
        return sum(v for k, v in peaks.items() if front is None or k.startswith(("worker", "rpc-server")) != front)

    rows = []
    for label, front in (("stages (workers / rpc-servers)", False), ("coordinator / llama-server", True),
                         ("all", None)):
        a, b = part(fleet, front), part(other, front)
        rows.append([label, f"{a:.0f}", f"{b:.0f}", f"{a / b:.2f}" if b else ""])
    return harness.table(["peak RSS MiB", "fleet", name, "÷"], rows).splitlines()


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """Greedy answers compared per prompt in the largest cell: how many are identical and how many
    leading characters each pair shares (both run the same GGUF, with different kernels)."""
    a, b = ours[-1]["answers"], theirs[-1]["answers"]
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)]
    return {"identical": sum(s == t for s, t in zip(a, b)), "answers": len(a), "common_prefix_chars": prefix}


def fleet_args() -> tuple[str, ...]:
    """The coordinator's arguments for a like-for-like run: no prefix cache where it has one (llama.cpp's
    prompt cache is off too; the bench repeats its prompts)."""
    from coordinator.settings import CoordinatorSettings

    return ("--no-prefix-cache",) if "prefix_cache" in CoordinatorSettings.model_fields else ()


def compare(gguf: Path, cache: Path, users_list: list[int], tokens: int, args: argparse.Namespace) -> int:
    """Run the comparison (module docstring) on GGUF file ``gguf``, print its tables and write ``args.json``;
    returns 0. Raises ``FileNotFoundError`` without the llama.cpp binaries, ``models.ModelError`` if ``gguf``
    is not a GGUF file."""
    gguf = models.require_gguf(models.resolve(gguf), "the llama.cpp comparison")
    bins = binaries(args.llama_cpp_bin or DEFAULT_BIN)
    logs = cache / "logs"
    build = harness.ensure_build(gguf, cache, 2)
    split = tensor_split(json.loads((build / "manifest.json").read_text())["stages"])
    print(f"llama.cpp comparison: {gguf.name}, fleet build {build.name}, --tensor-split {split}, {tokens} tokens "
          f"per user, users {users_list}, {args.repeats} repeats, nproc {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    notes, systems = [], {}
    load = [os.getloadavg()[0]]
    with ExitStack() as stack:
        fleet = stack.enter_context(harness.Fleet(build, logs, "--log-level", "WARNING", *fleet_args(), shards=[0, 1],
                                                  worker_args=("--threads", "1"), pin=True, prefix="llamacpp-fleet-"))
        warm_up(fleet.url)
        systems[FLEET] = System(fleet.url, fleet.processes())
        try:
            systems[RPC] = start_rpc_fleet(bins, gguf, split, max(users_list), logs, stack)
        except (RuntimeError, TimeoutError) as exc:
            notes.append(f"llama.cpp's RPC fleet did not run here, so one llama-server process stands in: {exc}")
            print(notes[-1], flush=True)
        if args.llama_cpp_single or RPC not in systems:
            systems[SINGLE] = start_single(bins[0], gguf, max(users_list), logs, stack)
        cells = measure(systems, users_list, tokens, args.repeats)
        memory = {name: peak_rss_mib(s.procs) for name, s in systems.items()}
        commands = {name: s.commands() for name, s in systems.items()}
    load.append(os.getloadavg()[0])
    report(cells, memory, notes)
    harness.write_json(args.json, "interleave_bench --llama-cpp", {
        "gguf": str(gguf), "fleet_build": str(build), "llama_cpp_python": LLAMA_CPP_PYTHON,
        "tokens": tokens, "repeats": args.repeats, "tensor_split": split, "cells": cells,
        "peak_rss_mib": memory, "notes": notes, "load_average_1min": load,
        "fleet_over": {name: [{"users": a["users"], **{k: paired_ratio(a, b, k) for k, _ in METRICS}}
                              for a, b in zip(cells[FLEET], c)] for name, c in cells.items() if name != FLEET},
        "agreement": {name: agreement(cells[FLEET], c) for name, c in cells.items() if name != FLEET},
        "commands": commands})
    return 0


def report(cells: dict[str, list[dict]], memory: dict[str, dict[str, float]], notes: list[str]) -> None:
    """Print the comparison tables (fleet ÷ each llama.cpp configuration), memory and answer agreement."""
    for name in cells:
        if name == FLEET:
            continue
        print(f"\nfleet (2 stages) vs {name}, fleet ÷ {name} per cell:")
        print("\n".join(comparison_table(cells[FLEET], cells[name], name)))
        print("\n".join(["", *memory_rows(memory[FLEET], memory[name], name)]))
        same = agreement(cells[FLEET], cells[name])
        print(f"greedy answers identical to the fleet's: {same['identical']}/{same['answers']} "
              f"(common prefix, characters: {same['common_prefix_chars']})")
    for note in notes:
        print(note)
