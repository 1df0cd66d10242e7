"""``fleet-chat``: a terminal chat with a fleet on the LAN (found by zeroconf, or ``--url``).

With ``--tools FILE.json`` (OpenAI function tools) the model may answer with tool calls: they are printed
(name and arguments, labelled), the user types each call's result at a ``result of NAME>`` prompt, and
the results go back as ``role: "tool"`` messages for the model's next turn."""

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

from .status import StatusLine, health_progress, preparing_status, retry_after, sse_status


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


DEFAULT_WAIT_S = 600.0  # --wait-s: how long fleet-chat waits for a fleet being prepared
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


def load_tools(path: str) -> list[dict]:
    """The OpenAI function tools of the JSON file at ``path`` (a list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}``, sent as the request's ``tools``); raises ``ChatError``
    naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except (OSError, ValueError) as exc:
        raise ChatError(f"--tools {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(tools, list) or not tools:
        raise ChatError(f"--tools {path}: must hold a non-empty JSON list of tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatError(f"--tools {path}: tool {i + 1} is not {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"parameters\": {...}}} (OpenAI's function tool)")
    return tools


def tool_fields(args: argparse.Namespace) -> dict:
    """The request's ``tools`` and ``tool_choice`` from ``--tools`` and ``--tool-choice`` (auto, required,
    none or a tool's name); {} without ``--tools``. Raises ``ChatError`` for a ``--tool-choice`` that
    names no tool of the file, or comes without ``--tools``."""
    if not args.tools:
        if args.tool_choice is not None:
            raise ChatError("--tool-choice needs --tools FILE.json (the tools to choose from)")
        return {}
    tools = load_tools(args.tools)
    choice = args.tool_choice
    if choice is None or choice in ("auto", "required", "none"):
        return {"tools": tools, **({"tool_choice": choice} if choice else {})}
    if choice not in {t["function"]["name"] for t in tools}:
        raise ChatError(f"--tool-choice {choice}: no tool of that name in {args.tools} (or auto, required, none)")
    return {"tools": tools, "tool_choice": {"type": "function", "function": {"name": choice}}}


def stream_reply(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> dict:
    """Send the conversation, print the answer as it streams (tool calls labelled, their arguments as they
    come), then a tokens/s line; return the answer as an assistant message (``content``, and
    ``tool_calls`` in OpenAI's shape when it made calls).

    Raises ``ContextFull`` when the server says the conversation is too long, ``ChatError`` for
    other API errors and ``httpx.HTTPError`` for transport failures."""
    tools = dict(getattr(args, "tool_fields", {}))
    if messages and messages[-1]["role"] == "tool":  # a forced choice is for the turn after the question:
        tools.pop("tool_choice", None)  # with the results in, the model answers (or calls again: auto)
    body = {"messages": messages, "stream": True, **args.sampling, **tools, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    try:
        with quiet_terminal():
            return _stream(client, url, body, parts)
    except KeyboardInterrupt:
        raise Interrupted("".join(parts)) from None


class CallPrinter:
    """The streamed ``delta.tool_calls`` pieces of one answer joined into calls (OpenAI's rules: a piece's
    ``index`` names its call, the first brings ``id`` and ``function.name``, each may bring more of
    ``function.arguments``) and printed as they come: ``[tool call NAME · ID] ARGUMENTS``, dimmed on a
    terminal."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.pieces = 0  # the pieces taken (about one token each)
        self.style = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")

    def take(self, pieces: list, after_text: bool) -> None:
        """Join and print one chunk's pieces; ``after_text``: the answer's text so far does not end a line."""
        for piece in pieces if isinstance(pieces, list) else []:
            index = piece.get("index") if isinstance(piece, dict) else None
            if not isinstance(index, int) or not 0 <= index <= len(self.calls):
                continue
            function = piece.get("function") or {}
            if index == len(self.calls):
                self.calls.append({"id": piece.get("id") or "", "type": "function",
                                   "function": {"name": function.get("name") or "", "arguments": ""}})
                name = self.calls[index]["function"]["name"]
                lead = "\n" if after_text or index else ""
                print(f"{lead}{self.style[0]}[tool call {name} · {self.calls[index]['id']}]{self.style[1]} ",
                      end="", flush=True)
                after_text = False
            self.pieces += 1
            arguments = function.get("arguments") or ""
            self.calls[index]["function"]["arguments"] += arguments
            if arguments:
                print(f"{self.style[0]}{arguments}{self.style[1]}", end="", flush=True)


def _stream(client: httpx.Client, url: str, body: dict, parts: list[str]) -> dict:
    """``stream_reply``'s request: the answer's pieces go to ``parts`` as they arrive; the coordinator's SSE
    comments (a re-plan's progress, a failover's replay) show on a ``StatusLine`` until tokens flow again."""
    t0 = time.perf_counter()
    calls, status = CallPrinter(), StatusLine()
    try:
        return _read_stream(client, url, body, parts, calls, status, t0)
    finally:
        status.clear()


def _read_stream(client: httpx.Client, url: str, body: dict, parts: list[str], calls: CallPrinter,
                 status: StatusLine, t0: float) -> dict:
    """``_stream``'s request and its events: the answer printed, the coordinator's comments on ``status``."""
    usage, finish, t_first = None, None, None
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
            if (comment := sse_status(line)) is not None:
                status.show(comment, mid_line=bool(parts) and not parts[-1].endswith("\n"))
                continue
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            status.clear()
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
                if choice["delta"].get("tool_calls"):
                    t_first = t_first or time.perf_counter()
                    calls.take(choice["delta"]["tool_calls"], bool(parts) and not parts[-1].endswith("\n"))
    print(flush=True)
    elapsed = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else len(parts) + calls.pieces
    ttft = (t_first - t0) if t_first else elapsed
    rate = (n - 1) / (elapsed - ttft) if n > 1 and elapsed > ttft else 0.0
    cut = ", cut at --max-tokens" if finish == "length" else ""
    print(f"[{n} tokens{cut}, {rate:.1f} tok/s, first token after {ttft * 1000:.0f} ms]", file=sys.stderr)
    message: dict = {"role": "assistant", "content": "".join(parts)}
    if calls.calls:
        message["tool_calls"] = calls.calls
        message["content"] = message["content"] or None
    return message


def ask(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> dict:
    """``stream_reply``, dropping the oldest turns (a question with its answers, calls and results; never
    the system prompt) while the context is full."""
    while True:
        try:
            return stream_reply(client, url, messages, args)
        except ContextFull:
            first = 1 if messages and messages[0]["role"] == "system" else 0
            following = [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]
            if not following:
                raise ChatError("this message alone is longer than the model's context; shorten it") from None
            del messages[first:following[0]]
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
    parser.add_argument("-p", "--prompt", action="append", help="ask this and exit (repeat for several turns; "
                        "after a tool call the next one is the call's result)")
    parser.add_argument("--tools", metavar="FILE.json", help="offer the model these tools (a JSON list of OpenAI "
                        "function tools); you type each call's result at the 'result of NAME>' prompt")
    parser.add_argument("--tool-choice", help="with --tools: auto (default), required, none, or a tool's name")
    parser.add_argument("--api-key", help="API key of a coordinator started with --api-key-file (default: "
                        "$FLEET_API_KEY; else $OPENAI_API_KEY, but only with --url: a key for another service is "
                        "never sent to a coordinator found by zeroconf, which anyone on the LAN can announce)")
    parser.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S, help="how long to wait for a coordinator "
                        "that is still preparing its fleet (serve --model SOURCE: collecting workers, building, "
                        f"shipping), its progress shown meanwhile (default {DEFAULT_WAIT_S:.0f}; Ctrl-C stops)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the technical details of errors too")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("FLEET_API_KEY") or (os.environ.get("OPENAI_API_KEY") if args.url else None)
    return args


def _report(error: ChatError, args: argparse.Namespace) -> None:
    print(f"fleet-chat: {error.message}", file=sys.stderr)
    if args.verbose and error.detail:
        print(f"fleet-chat: details: {error.detail}", file=sys.stderr)


def wait_for_fleet(client: httpx.Client, url: str, wait_s: float, status: StatusLine | None = None) -> httpx.Response:
    """``/v1/models`` of the coordinator at ``url``, waiting while it prepares its fleet (503 ``fleet_preparing``):
    its progress (``/health``'s, else the 503's) on ``status``, the next try after its Retry-After (the API
    takes over the preparing page's listening socket: the port never refuses in between). Raises ``ChatError``
    after ``wait_s`` seconds, or for no answer at all (a coordinator that exited, its preparation failed, at
    once); Ctrl-C raises ``KeyboardInterrupt`` (the status line cleared)."""
    status = status or StatusLine()
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                response = client.get(f"{url}/v1/models")
            except httpx.HTTPError as exc:
                raise transport_error(exc, url) from None
            said = preparing_status(response)
            if said is None:
                return response
            seen = health_progress(client, url) or said
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChatError(f"the fleet at {url} is still being prepared after {wait_s:.0f} s ({seen}); wait "
                                "longer with --wait-s, or look at the coordinator's log")
            pause = min(retry_after(response), left)
            status.show(f"fleet-chat: waiting for the fleet at {url} to be ready: {seen} (next try in {pause:.0f} s)")
            time.sleep(pause)
    finally:
        status.clear()


def served_model(client: httpx.Client, url: str, wait_s: float = 0.0) -> tuple[str, dict]:
    """The model the coordinator at ``url`` serves and the sampling to send when the user sets none (its
    ``fallback_sampling``, {} when absent), after waiting up to ``wait_s`` for a fleet being prepared
    (``wait_for_fleet``); raises ``ChatError`` when it does not answer as a coordinator."""
    response = wait_for_fleet(client, url, wait_s)
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


def _next_prompt(prompts: Iterator[str] | None, read, prompt: str = "> ") -> str | None:
    """The user's next message (or a tool's result, at its ``prompt``); None to quit (end of the -p prompts,
    Ctrl-D, Ctrl-C or an empty line). ``read(prompt) -> str`` reads a line."""
    if prompts is not None:
        user = next(prompts, None)
        if user is not None:
            print(f"{prompt}{user}")
        return user if user and user.strip() else None
    try:
        user = read(prompt)
    except (EOFError, KeyboardInterrupt):
        print()
        return None
    return user if user.strip() else None


def _keep_interrupted(messages: list[dict], partial: str) -> None:
    """After Ctrl-C: the turn stays with its partial answer (its text: a call cut off is dropped), or the
    question goes when nothing came (tool results stay), and either is said."""
    if partial:
        messages.append({"role": "assistant", "content": partial})
        print("\n(interrupted; kept in the conversation)", file=sys.stderr)
    elif messages[-1]["role"] == "tool":
        print("\n(interrupted before the answer began; the tool results stay in the conversation)",
              file=sys.stderr)
    else:
        messages.pop()
        print("\n(interrupted before the answer began; the question was dropped from the conversation)",
              file=sys.stderr)


def _answer(client: httpx.Client, url: str, messages: list[dict], args: argparse.Namespace) -> dict | int:
    """The model's next turn appended to ``messages`` and returned; after Ctrl-C (130) or an error (1),
    the status instead (the question dropped when nothing came, as ``_keep_interrupted`` says)."""
    try:
        answer = ask(client, url, messages, args)
    except (Interrupted, KeyboardInterrupt) as exc:
        _keep_interrupted(messages, exc.partial if isinstance(exc, Interrupted) else "")
        return 130
    except (ChatError, httpx.HTTPError) as exc:
        print(file=sys.stderr)
        _report(exc if isinstance(exc, ChatError) else transport_error(exc, url, answering=True), args)
        if messages[-1]["role"] == "user":
            messages.pop()
        return 1
    messages.append(answer)
    return answer


def _converse(client: httpx.Client, url: str, args: argparse.Namespace) -> int:
    """Ask the ``-p`` prompts (then exit) or read them from the terminal; after an answer with tool calls,
    each call's result (the next ``-p`` prompt, or a line at ``result of NAME>``) goes back as a tool
    message and the model answers again. The exit status."""
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    prompts = iter(args.prompt) if args.prompt else None
    read = line_reader() if prompts is None else input
    while (user := _next_prompt(prompts, read)) is not None:
        messages.append({"role": "user", "content": user})
        answer = _answer(client, url, messages, args)
        while isinstance(answer, dict) and answer.get("tool_calls"):
            for call in answer["tool_calls"]:
                result = _next_prompt(prompts, read, f"result of {call['function']['name']}> ")
                if result is None:
                    return 0
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            answer = _answer(client, url, messages, args)
        if isinstance(answer, int) and prompts is not None:
            return answer
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
            model, fallback = served_model(client, url, args.wait_s)
        except ChatError as exc:
            _report(exc, args)
            return 2
        except KeyboardInterrupt:
            print("fleet-chat: interrupted while waiting for the fleet", file=sys.stderr)
            return 130
        args.sampling = sampling_fields(args, fallback)
        try:
            args.tool_fields = tool_fields(args)
        except ChatError as exc:
            _report(exc, args)
            return 2
        quits = "" if args.prompt else "; empty line or Ctrl-D quits"
        print(f"fleet-chat: connected to {url} ({model}){quits}", file=sys.stderr)
        return _converse(client, url, args)


if __name__ == "__main__":
    sys.exit(main())
