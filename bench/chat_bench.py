"""Multi-turn chat benchmark: TTFT per turn with and without prefix caching, one run, table + JSON.

Two fleets of the demo's 2-stage build (``--local-workers 2``, f32 as the demo runs, the build's
default draft) serve the same greedy 8-turn chat side by side: one with the prefix cache (the default),
one with ``--no-prefix-cache``. Each turn goes to both, in alternating order, as a streamed request;
TTFT is the client's (request sent -> first content chunk), beside the coordinator's own and the prompt
tokens it served from retained KV (``usage.prompt_tokens_details.cached_tokens``). Both fleets must give
the same answers (greedy, f32): the run stops if they differ.

Goal (issue 16): with reuse, turn 8's TTFT <= 1.5 x turn 2's.

    python bench/chat_bench.py [--turns 8] [--tokens 200] [--build DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a plain script: make the repo's packages importable

import httpx  # noqa: E402

from bench.decode_bench import stop_group, wait_healthy  # noqa: E402
from coordinator.local import free_port  # noqa: E402

QUESTIONS = [
    "Hi! I'm planning a weekend trip to Lisbon. What should I see first?",
    "What food should I try there?",
    "How do I get around the city?",
    "Is it worth taking a day trip to Sintra?",
    "What should I pack for the weather?",
    "Any tips for saving money while I'm there?",
    "What are some good evening activities?",
    "Can you sum up my plan in a short list?",
]


def start_fleet(build: Path, logs: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = logs / f"coordinator-{name}.log"
    cmd = [str(ROOT / ".venv" / "bin" / "fleet-coordinator"), "serve", "--model", str(build), "--port", str(port),
           "--local-workers", "2", "--no-discover", "--no-announce", "--inference-precision", "f32", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log)
    return proc, url


def ask(url: str, messages: list[dict], tokens: int) -> dict:
    """One streamed greedy turn: the answer, client TTFT (ms), and the final chunk's usage and fleet stats."""
    body = {"messages": messages, "temperature": 0, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    parts, first, tail = [], None, {}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tail = chunk
            for choice in chunk.get("choices", []):
                if text := choice.get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    parts.append(text)
    return {"text": "".join(parts), "ttft_ms": ((first or time.perf_counter()) - sent) * 1000,
            "server_ttft_ms": tail.get("fleet", {}).get("ttft_ms"), "prompt_tokens": tail["usage"]["prompt_tokens"],
            "cached_tokens": tail["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "ids": tail.get("fleet", {}).get("completion_token_ids")}


def run(build: Path, turns: int, tokens: int, logs: Path) -> list[dict]:
    fleets = {}
    try:
        fleets["reuse"] = start_fleet(build, logs, "reuse")
        fleets["fresh"] = start_fleet(build, logs, "fresh", "--no-prefix-cache")
        for url in (u for _, u in fleets.values()):  # warm both (first inferences are slow)
            ask(url, [{"role": "user", "content": "Hello"}], 8)
        messages, rows = [], []
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            order = ["reuse", "fresh"] if turn % 2 == 0 else ["fresh", "reuse"]
            got = {name: ask(fleets[name][1], messages, tokens) for name in order}
            if got["reuse"]["ids"] != got["fresh"]["ids"]:
                raise SystemExit(f"turn {turn + 1}: the fleets' greedy answers differ (prefix cache on vs off)")
            rows.append({"turn": turn + 1, "prompt_tokens": got["reuse"]["prompt_tokens"],
                         "cached_tokens": got["reuse"]["cached_tokens"],
                         "ttft_ms_reuse": got["reuse"]["ttft_ms"], "ttft_ms_fresh": got["fresh"]["ttft_ms"],
                         "server_ttft_ms_reuse": got["reuse"]["server_ttft_ms"],
                         "server_ttft_ms_fresh": got["fresh"]["server_ttft_ms"]})
            print(f"turn {turn + 1}: {rows[-1]['prompt_tokens']} prompt tokens, {rows[-1]['cached_tokens']} cached, "
                  f"TTFT {rows[-1]['ttft_ms_reuse']:.0f} vs {rows[-1]['ttft_ms_fresh']:.0f} ms", file=sys.stderr)
            messages.append({"role": "assistant", "content": got["reuse"]["text"]})
        return rows
    finally:
        for proc, _ in fleets.values():
            stop_group(proc)


def table(rows: list[dict]) -> str:
    lines = ["| turn | prompt tokens | cached | TTFT reuse ms | TTFT no reuse ms | reuse ÷ no reuse |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_ms_reuse']:.0f} | "
                     f"{r['ttft_ms_fresh']:.0f} | {r['ttft_ms_reuse'] / r['ttft_ms_fresh']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=ROOT / "models" / "smollm2-q4_1-2stage",
                        help="a 2-stage build (default: the demo's, made by deploy/demo.sh)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200, help="max tokens per answer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not (args.build / "manifest.json").is_file():
        raise SystemExit(f"{args.build} has no manifest.json: run deploy/demo.sh first (or pass --build)")
    logs = ROOT / "models" / "bench" / "chat-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = run(args.build, args.turns, args.tokens, logs)
    print(table(rows))
    goal = None
    if len(rows) >= 2:
        ratio = rows[-1]["ttft_ms_reuse"] / rows[1]["ttft_ms_reuse"]
        goal = {"turn_last_over_turn_2": ratio, "met": ratio <= 1.5}
        print(f"\nwith reuse, turn {rows[-1]['turn']} TTFT / turn 2 TTFT = {ratio:.2f} (goal <= 1.5: "
              f"{'met' if ratio <= 1.5 else 'missed'}); prompt tokens served from cache: "
              f"{sum(r['cached_tokens'] for r in rows)} of {sum(r['prompt_tokens'] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps({"bench": "chat", "build": str(args.build), "tokens": args.tokens,
                                         "machine": platform.node(), "cpus": os.cpu_count(), "rows": rows,
                                         "goal": goal}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
