"""``fleet-chat``: a terminal chat with a fleet on the LAN (found by zeroconf, or ``--url``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator

import httpx

from fleet_common import API_SERVICE_TYPE


def discover_apis(timeout_s: float = 2.0) -> list[tuple[str, str]]:
    """Every coordinator announced on the LAN within ``timeout_s`` (zeroconf, ``_fleet-api._tcp``), as
    (base URL ``http://host:port``, model) sorted by URL; the model is the announcement's TXT ``model``."""
    from zeroconf import ServiceBrowser, ServiceListener, Zeroconf

    found: dict[str, str] = {}

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            info = zc.get_service_info(type_, name, timeout=int(timeout_s * 1000))
            if info and info.parsed_addresses():
                model = (info.properties or {}).get(b"model", b"") or b""
                found[f"http://{info.parsed_addresses()[0]}:{info.port}"] = model.decode("utf-8", "replace")

        def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

    zc = Zeroconf()
    try:
        ServiceBrowser(zc, API_SERVICE_TYPE, Listener())
        time.sleep(timeout_s)  # wait the whole window: taking the first answer picked a fleet at random
    finally:
        zc.close()
    return sorted(found.items())


class NoCoordinator(RuntimeError):
    """No coordinator, or more than one, matches: the message lists them and says what to pass."""


def choose_api(found: list[tuple[str, str]], model: str | None, prog: str) -> str:
    """The one coordinator of ``found`` serving ``model`` (any model when None). Raises ``NoCoordinator``
    naming what was found when none matches, or when several do (never picks one silently)."""
    matches = [(url, m) for url, m in found if model is None or m == model]
    if len(matches) == 1:
        return matches[0][0]
    listing = "; ".join(f"{m or '?'} at {url}" for url, m in found)
    if not found:
        raise NoCoordinator(f"{prog}: no coordinator found with zeroconf; pass --url http://HOST:PORT")
    if not matches:
        raise NoCoordinator(f"{prog}: no coordinator serves model {model!r}; found: {listing}")
    raise NoCoordinator(f"{prog}: {len(matches)} coordinators found ({listing}); choose one with "
                        + ("--url" if model else "--model NAME or --url"))


class ContextFull(RuntimeError):
    """The conversation no longer fits the model's context."""


class Interrupted(Exception):
    """Ctrl-C during an answer; ``partial`` is the text received until then."""

    def __init__(self, partial: str) -> None:
        super().__init__("interrupted")
        self.partial = partial


SAMPLING_NAMES = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "repetition_penalty")
"""The fields of a coordinator's ``fallback_sampling`` fleet-chat sends (any other is left out)."""


def sampling_fields(args: argparse.Namespace, fallback: dict) -> dict:
    """The request's sampling fields: the user's flags; without any, the coordinator's ``fallback``
    (``fallback_sampling`` of its model in /v1/models: greedy with a small frequency penalty for a model
    without sampling defaults of its own, else nothing; a coordinator that serves none: nothing)."""
    body = {}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    for name in ("frequency_penalty", "repetition_penalty"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if not body:
        body = dict(fallback)
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.seed is not None:
        body["seed"] = args.seed
    return body


@contextlib.contextmanager
def quiet_terminal() -> Iterator[None]:
    """Keys typed while an answer streams are not echoed into it (they wait for the next prompt);
    Ctrl-C still interrupts. Does nothing when stdin is not a terminal."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    except (ImportError, OSError, ValueError, AttributeError):
        saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHONL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class ChatError(RuntimeError):
    """What went wrong, as one sentence for the user; ``detail`` holds the technical cause (``--verbose``)."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.message, self.detail = message, detail


def transport_error(exc: httpx.HTTPError, url: str, answering: bool = False) -> ChatError:
    """``exc`` (no answer from ``url``, or a broken connection) as one sentence that says what to do;
    ``answering``: it happened during an answer, not while connecting."""
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectError):
        return ChatError(f"nothing answers at {url}: start `fleet-coordinator serve` there, or pass the right "
                         "address with --url (without it, fleet-chat finds a coordinator with zeroconf)", detail)
    if isinstance(exc, httpx.ConnectTimeout):
        return ChatError(f"{url} does not answer (no connection after 5 s): check the address and that the "
                         "coordinator's port is reachable from here", detail)
    if isinstance(exc, httpx.TimeoutException):
        return ChatError(f"the coordinator at {url} sent nothing for 300 s; try again, or check its log", detail)
    if answering:
        return ChatError(f"the connection to {url} broke during the answer (did the coordinator stop?); send "
                         "the message again once it is back", detail)
    return ChatError(f"cannot talk to {url}: {type(exc).__name__}; check the address (--url)", detail)


def stream_reply(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> str:
    """Send the conversation, print the answer as it streams, then a tokens/s line; return the answer.

    Raises ``ContextFull`` when the server says the conversation is too long, ``ChatError`` for
    other API errors and ``httpx.HTTPError`` for transport failures."""
    body = {"messages": messages, "stream": True, **args.sampling, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    try:
        with quiet_terminal():
            return _stream(client, url, body, parts)
    except KeyboardInterrupt:
        raise Interrupted("".join(parts)) from None


def _stream(client: httpx.Client, url: str, body: dict, parts: list[str]) -> str:
    """``stream_reply``'s request: the answer's pieces go to ``parts`` as they arrive."""
    usage, finish, t0, t_first = None, None, time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            try:
                error = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                error = {"message": response.text}
            if error.get("code") == "context_length_exceeded":
                raise ContextFull(error["message"])
            raise ChatError(str(error.get("message")), f"HTTP {response.status_code}, code {error.get('code')}"
                            + (f": {error['detail']}" if error.get("detail") else ""))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                raise ChatError(str(error.get("message")), f"mid-answer, code {error.get('code')}"
                                + (f": {error['detail']}" if error.get("detail") else ""))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
                text = choice["delta"].get("content")
                if text:
                    t_first = t_first or time.perf_counter()
                    parts.append(text)
                    print(text, end="", flush=True)
    print(flush=True)
    elapsed = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else len(parts)
    ttft = (t_first - t0) if t_first else elapsed
    rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    cut = ", cut at --max-tokens" if finish == "length" else ""
    print(f"[{n} tokens{cut}, {rate:.1f} tok/s, first token after {ttft * 1000:.0f} ms]", file=sys.stderr)
    return "".join(parts)


def ask(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> str:
    """``stream_reply``, dropping the oldest turns (never the system prompt) while the context is full."""
    while True:
        try:
            return stream_reply(client, url, messages, args)
        except ContextFull:
            first = 1 if messages and messages[0]["role"] == "system" else 0
            if len(messages) - first <= 1:
                raise ChatError("this message alone is longer than the model's context; shorten it") from None
            del messages[first:first + 2]
            print("[conversation too long for the model: dropped the oldest turn]", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """fleet-chat's command line; ``--api-key`` defaults to $FLEET_API_KEY, else (with ``--url`` only)
    $OPENAI_API_KEY."""
    parser = argparse.ArgumentParser(prog="fleet-chat", description=__doc__)
    parser.add_argument("--url", help="coordinator base URL, e.g. http://192.168.1.20:8000 (default: zeroconf)")
    parser.add_argument("--model", help="with several coordinators on the LAN, the one serving this model "
                                        "(as `fleet-coordinator status` and the list fleet-chat prints name it)")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-tokens", type=int, help="longest answer in tokens (default: the model's, else the "
                        "coordinator's --max-tokens-default, 512)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: the model's generation_config.json; "
                        "without sampling defaults there, the coordinator's fallback: greedy with a small "
                        "--frequency-penalty)")
    parser.add_argument("--frequency-penalty", type=float, help="OpenAI's: > 0 discourages repeating the answer's "
                        "tokens, by how often they came (default: see --temperature)")
    parser.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeating the conversation's tokens "
                        "(default: the model's)")
    parser.add_argument("--seed", type=int, help="sampling seed, for reproducible answers")
    parser.add_argument("-p", "--prompt", action="append", help="ask this and exit (repeat for several turns)")
    parser.add_argument("--api-key", help="API key of a coordinator started with --api-key-file (default: "
                        "$FLEET_API_KEY; else $OPENAI_API_KEY, but only with --url: a key for another service is "
                        "never sent to a coordinator found by zeroconf, which anyone on the LAN can announce)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the technical details of errors too")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("FLEET_API_KEY") or (os.environ.get("OPENAI_API_KEY") if args.url else None)
    return args


def _report(error: ChatError, args: argparse.Namespace) -> None:
    print(f"fleet-chat: {error.message}", file=sys.stderr)
    if args.verbose and error.detail:
        print(f"fleet-chat: details: {error.detail}", file=sys.stderr)


def served_model(client: httpx.Client, url: str) -> tuple[str, dict]:
    """The model the coordinator at ``url`` serves and the sampling to send when the user sets none (its
    ``fallback_sampling``, {} when absent); raises ``ChatError`` when it does not answer as a coordinator."""
    try:
        response = client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise transport_error(exc, url) from None
    try:
        if response.status_code == 401:
            raise ChatError(f"{url} refused the API key: {response.json()['error']['message']}")
        model = response.json()["data"][0]
        name, fallback = model["id"], model.get("fallback_sampling")
        fallback = fallback if isinstance(fallback, dict) else {}
        # sampling fields with finite numbers only (as the chat page takes them): never the request's messages
        return name, {k: v for k, v in fallback.items() if k in SAMPLING_NAMES and isinstance(v, (int, float))
                      and not isinstance(v, bool) and math.isfinite(v)}
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ChatError(f"{url} answers, but not as a fleet coordinator (HTTP {response.status_code} for "
                        "/v1/models): check the address (--url)", f"{type(exc).__name__}: {exc}") from None


def line_reader() -> callable:  # type: ignore[valid-type]
    """A ``read(prompt) -> str`` for the user's turns: prompt_toolkit (line editing, arrow-key history)
    on a terminal, plain ``input`` otherwise (pipes, tests). Raises ``EOFError``/``KeyboardInterrupt``."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return input
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    return PromptSession(history=InMemoryHistory()).prompt


def _next_prompt(prompts: Iterator[str] | None, read) -> str | None:  # noqa: ANN001 - read(prompt) -> str
    """The user's next message; None to quit (end of the -p prompts, Ctrl-D, Ctrl-C or an empty line)."""
    if prompts is not None:
        user = next(prompts, None)
        if user is not None:
            print(f"> {user}")
        return user if user and user.strip() else None
    try:
        user = read("> ")
    except (EOFError, KeyboardInterrupt):
        print()
        return None
    return user if user.strip() else None


def _keep_interrupted(messages: list[dict], partial: str) -> None:
    """After Ctrl-C: the turn stays with its partial answer, or goes when nothing came, and either is said."""
    if partial:
        messages.append({"role": "assistant", "content": partial})
        print("\n(interrupted; kept in the conversation)", file=sys.stderr)
    else:
        messages.pop()
        print("\n(interrupted before the answer began; the question was dropped from the conversation)",
              file=sys.stderr)


def _converse(client: httpx.Client, url: str, args: argparse.Namespace) -> int:
    """Ask the ``-p`` prompts (then exit) or read them from the terminal; the exit status."""
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    prompts = iter(args.prompt) if args.prompt else None
    read = line_reader() if prompts is None else input
    while (user := _next_prompt(prompts, read)) is not None:
        messages.append({"role": "user", "content": user})
        try:
            answer = ask(client, url, messages, args)
        except (Interrupted, KeyboardInterrupt) as exc:
            _keep_interrupted(messages, exc.partial if isinstance(exc, Interrupted) else "")
            if prompts is not None:
                return 130
            continue
        except (ChatError, httpx.HTTPError) as exc:
            print(file=sys.stderr)
            _report(exc if isinstance(exc, ChatError) else transport_error(exc, url, answering=True), args)
            messages.pop()
            if prompts is not None:
                return 1
            continue
        messages.append({"role": "assistant", "content": answer})
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleet-chat`` console script."""
    args = parse_args(argv)
    try:
        url = args.url or choose_api(discover_apis(), args.model, "fleet-chat")
    except NoCoordinator as exc:
        print(exc, file=sys.stderr)
        return 2
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0), headers=headers) as client:
        try:
            model, fallback = served_model(client, url)
        except ChatError as exc:
            _report(exc, args)
            return 2
        args.sampling = sampling_fields(args, fallback)
        quits = "" if args.prompt else "; empty line or Ctrl-D quits"
        print(f"fleet-chat: connected to {url} ({model}){quits}", file=sys.stderr)
        return _converse(client, url, args)


if __name__ == "__main__":
    sys.exit(main())
