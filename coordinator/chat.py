"""``fleet-chat``: a terminal chat with a fleet on the LAN (found by zeroconf, or ``--url``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

from fleet_common import API_SERVICE_TYPE


def discover_api(timeout_s: float = 3.0) -> str | None:
    """Base URL (``http://host:port``) of the first coordinator announced on the LAN, or None."""
    from zeroconf import ServiceBrowser, ServiceListener, Zeroconf

    found: list[str] = []

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            info = zc.get_service_info(type_, name, timeout=int(timeout_s * 1000))
            if info and info.parsed_addresses():
                found.append(f"http://{info.parsed_addresses()[0]}:{info.port}")

        def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

    zc = Zeroconf()
    try:
        ServiceBrowser(zc, API_SERVICE_TYPE, Listener())
        deadline = time.monotonic() + timeout_s
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        zc.close()
    return found[0] if found else None


def stream_reply(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> str:
    """Send the conversation, print the answer as it streams, then a tokens/s line; return the answer."""
    body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream_options": {"include_usage": True}}
    if args.seed is not None:
        body["seed"] = args.seed
    parts, usage, t0, t_first = [], None, time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError):
                message = response.text
            raise RuntimeError(f"HTTP {response.status_code}: {message}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    t_first = t_first or time.perf_counter()
                    parts.append(text)
                    print(text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else len(parts)
    ttft = (t_first - t0) if t_first else elapsed
    rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    print(f"\n[{n} tokens, {rate:.1f} tok/s, first token after {ttft * 1000:.0f} ms]", file=sys.stderr)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-chat`` console script."""
    parser = argparse.ArgumentParser(prog="fleet-chat", description=__doc__)
    parser.add_argument("--url", help="coordinator base URL, e.g. http://192.168.1.20:8000 (default: zeroconf)")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("-p", "--prompt", action="append", help="ask this and exit (repeat for several turns)")
    args = parser.parse_args(argv)

    url = args.url or discover_api()
    if not url:
        print("fleet-chat: no coordinator found with zeroconf; pass --url http://HOST:PORT", file=sys.stderr)
        return 2
    url = url.rstrip("/")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    prompts = iter(args.prompt) if args.prompt else None
    print(f"fleet-chat: connected to {url} (empty line or Ctrl-D quits)", file=sys.stderr)
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as client:
        while True:
            if prompts is not None:
                user = next(prompts, None)
                if user is None:
                    return 0
                print(f"> {user}")
            else:
                try:
                    user = input("> ")
                except EOFError:
                    return 0
            if not user.strip():
                return 0
            messages.append({"role": "user", "content": user})
            try:
                answer = stream_reply(client, url, messages, args)
            except (RuntimeError, httpx.HTTPError) as exc:
                print(f"\nfleet-chat: {exc}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
