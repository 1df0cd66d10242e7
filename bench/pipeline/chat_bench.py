"""Multi-turn chat benchmark: TTFT per turn with and without prefix caching, one run, table + JSON.

Two fleets of the demo's 2-stage build (``--local-workers 2``, f32 as the demo runs, the build's
default draft) serve the same greedy 8-turn chat side by side: one with the prefix cache (the default),
one with ``--no-prefix-cache``. Each turn goes to both, in alternating order, as a streamed request;
TTFT is the client's (request sent -> first content chunk), beside the coordinator's own and the prompt
tokens it served from retained KV (``usage.prompt_tokens_details.cached_tokens``). Both fleets must give
the same answers (greedy, f32): the run stops if they differ.

Goal (issue 16): with reuse, turn 8's TTFT <= 1.5 x turn 2's.

    python bench/pipeline/chat_bench.py [--turns 8] [--tokens 200] [--build DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench import clients, harness

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


def start_fleet(build: Path, logs: Path, name: str, stack: ExitStack, *extra: str) -> str:
    """A coordinator with 2 local workers (f32, the build's default draft), stopped when ``stack`` closes;
    its URL once every stage is served."""
    _, url = harness.start_coordinator(build, logs / f"coordinator-{name}.log", "--local-workers", "2",
                                       "--no-discover", "--inference-precision", "f32", *extra, stack=stack,
                                       healthy=True)
    return url


def ask(client: httpx.Client, url: str, messages: list[dict], tokens: int) -> dict:
    """One streamed greedy turn: the answer, client TTFT (ms), and the final chunk's usage and fleet stats."""
    s = clients.stream_chat(client, url, messages, tokens, greedy=False, extra={"temperature": 0}, timeout=300)
    return {"text": s.text, "ttft_ms": s.ttft_ms, "server_ttft_ms": s.fleet.get("ttft_ms"),
            "prompt_tokens": s.usage["prompt_tokens"],
            "cached_tokens": (s.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "ids": s.fleet.get("completion_token_ids")}


def run(build: Path, turns: int, tokens: int, logs: Path) -> list[dict]:
    """The chat, turn by turn on both fleets (alternating which goes first); one row per turn. Exits if the
    fleets' greedy answers differ."""
    with ExitStack() as stack, httpx.Client() as client:
        urls = {"reuse": start_fleet(build, logs, "reuse", stack),
                "fresh": start_fleet(build, logs, "fresh", stack, "--no-prefix-cache")}
        for url in urls.values():  # warm both (first inferences are slow)
            ask(client, url, [{"role": "user", "content": "Hello"}], 8)
        messages, rows = [], []
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            order = ["reuse", "fresh"] if turn % 2 == 0 else ["fresh", "reuse"]
            got = {name: ask(client, urls[name], messages, tokens) for name in order}
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


def table(rows: list[dict]) -> str:
    """The markdown table of the turns: prompt and cached tokens, TTFT with and without reuse, their ratio."""
    return harness.table(
        ["turn", "prompt tokens", "cached", "TTFT reuse ms", "TTFT no reuse ms", "reuse ÷ no reuse"],
        [[r["turn"], r["prompt_tokens"], r["cached_tokens"], f"{r['ttft_ms_reuse']:.0f}", f"{r['ttft_ms_fresh']:.0f}",
          f"{r['ttft_ms_reuse'] / r['ttft_ms_fresh']:.2f}"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run the chat on both fleets (module docstring); prints the table and the goal, writes ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=harness.ROOT / "models" / "smollm2-q4_1-2stage",
                        help="a 2-stage build (default: the demo's, made by deploy/demo.sh)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200, help="max tokens per answer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not (args.build / "manifest.json").is_file():
        raise SystemExit(f"{args.build} has no manifest.json: run deploy/demo.sh first (or pass --build)")
    logs = harness.CACHE / "chat-logs"
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
    harness.write_json(args.json, "chat_bench", {"build": str(args.build), "tokens": args.tokens, "rows": rows,
                                                 "goal": goal})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
