"""What the fuzz tests share (test_fuzz.py, test_hostile_requests.py): hypothesis strategies of malformed gRPC
messages, ``WorkerFuzz`` (throws them at a real worker and records every answer), ``Results``, and the steps
that check a worker still answers a valid request exactly as before (``reference_step``, ``run_fuzz``)."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fleet_common import fleet_pb2 as pb
from fleet_common.manifest import load_manifest
from fleet_common.wire import from_tensor, to_tensor
from tests.conftest import Proc

DEADLINE_S = 30.0
"""Deadline of every fuzz call. Answers take milliseconds, but the first chunk of a new shape makes
OpenVINO build its kernels, which took up to ~5 s while parallel tests loaded this 2-core machine, and a
valid [3, 1000] chunk of a merged group runs 3,000 tokens through stage 0 (over 15 s once, in a suite run
at load ~2); a call still unanswered after 30 s counts as a hang."""

RSS_TOLERANCE_MIB = 64
"""RSS may end this far above the baseline taken after warm-up: glibc keeps some freed heap in its
arenas (the worker trims after closing sessions, not after every call), OpenVINO keeps per-shape
kernel caches for the chunk shapes it met, and gRPC keeps its buffer pools. A leak of one session's
KV per example, or of one channel per fuzzed route, would exceed it many times over."""

FUZZ = settings(deadline=None, database=None, derandomize=True, print_blob=False,
                phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure names its message
                suppress_health_check=list(HealthCheck))

# -- reading a process ---------------------------------------------------------------------------


def rss_mib(proc: Proc) -> float:
    """Resident set size of ``proc`` (``VmRSS`` of /proc/PID/status), MiB."""
    text = Path(f"/proc/{proc.popen.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


# -- the worker side -----------------------------------------------------------------------------

SERVICE = "/fleet.v1.Stage/"
UNARY = {"OpenSession": pb.OpenSessionReply, "CloseSession": pb.CloseSessionReply, "Forward": pb.ForwardReply,
         "Compact": pb.CompactReply, "Merge": pb.MergeReply, "Info": pb.InfoReply}
UNKNOWN_PATHS = [SERVICE + "Nope", SERVICE, "/fleet.v1.Stage/forward", "/fleet.v2.Stage/Forward",
                 "/grpc.health.v1.Health/Check", "/x", "/" + "A" * 300]
CLEAN_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNIMPLEMENTED}
"""What a worker may answer a malformed message: never UNKNOWN / INTERNAL (an unhandled exception),
DEADLINE_EXCEEDED (a hang), CANCELLED or UNAVAILABLE (a crash)."""
SUBSCRIBER = "fuzz-results"
BIG_CHANNEL = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

U32_EDGES = [0, 1, 2, 3, 4, 7, 8, 255, 256, 257, 4095, 4096, 8192, 8193, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
I64_EDGES = [-2**63, -2**32, -1, 0, 1, 2, 3, 575, 576, 577, 2**31, 2**32, 2**62, 2**63 - 1]

# Every strategy is built once, here. A structured message is valid but for one to three of its fields
# ("broken"); the valid values depend on the worker's state (its live sessions and their lengths)
# and are filled in when the message is built: ``Near`` is the right value plus a delta, ``Live``
# names another live session.
@dataclass(frozen=True)
class Near:
    delta: int


@dataclass(frozen=True)
class Live:
    index: int


def near(value: object, good: int) -> int:
    return max(0, good + value.delta) if isinstance(value, Near) else value


U32 = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))
NEAR = st.one_of(st.integers(-2, 2).map(Near), U32)
U32S = st.lists(U32, max_size=6)
ODD_IDS = st.one_of(st.just(""), st.text(st.characters(codec="utf-8"), max_size=24),  # protobuf strings are UTF-8
                    st.sampled_from(["fz-never-opened", "x" * 20_000, "\x00", "🦀" * 300]))
SESSION = st.one_of(st.integers(0, 7).map(Live), ODD_IDS, st.just("fz-group"))
UNREACHABLE = "127.0.0.1:1"  # refused at once: nothing listens on port 1
ROUTES = st.lists(st.one_of(
    st.sampled_from(["", ":", "host", "127.0.0.1:", ":50051", "127.0.0.1:0", "127.0.0.1:99999", "[::1]:70000",
                     "127.0.0.1:abc", "127.0.0.1:-1", "127.0.0.1:1 ", "\x00", "dns:///", "unix:", "a" * 10_000]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters=":"), max_size=40),  # no port: never dialled
    # well-formed but refused at once: every one of these loopback addresses is a channel of its own
    st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(1, 255)).map(lambda t: "127.%d.%d.%d:1" % t),
), max_size=3)
HIDE_SLOTS = st.one_of(st.lists(st.integers(0, 8), min_size=1, max_size=6), U32S,
                       st.integers(0, 50_000).map(lambda n: list(range(n))))  # a long list, all but a few out of range
ROWS = st.one_of(st.lists(st.integers(0, 3), min_size=1, max_size=4), U32S)
GARBAGE = st.binary(max_size=160)
BAD_TENSOR = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from(["int64", "float32", "int32", "float16", "float64", "bool", "object",
                                                 "<f4", "", "int64 "])),
    st.tuples(st.just("bytes"), st.integers(-9, 9).filter(bool)),  # bytes cut off or added
    st.tuples(st.just("shape"), st.tuples(
        st.lists(st.one_of(st.sampled_from(I64_EDGES), st.integers(-2**63, 2**63 - 1)), max_size=6),
        st.sampled_from(["int64", "float32", "int32", "float16", "float64", ""]), GARBAGE)),
    st.tuples(st.just("rows"), st.integers(0, 3)),
    st.tuples(st.just("seq"), st.sampled_from([0, 257, 1000])),  # empty, or beyond the session's 256 slots
    st.tuples(st.just("width"), st.sampled_from([0, 1, -1, +1])),  # hidden size 0, 1, or the right one +-1
    st.tuples(st.just("ndim"), st.sampled_from([1, 2, 3, 4])),
    st.tuples(st.just("value"), st.tuples(st.integers(0, 2**20), st.sampled_from(["low", "high", "huge"]))),
)
FORWARD_BAD = {
    "session_id": SESSION, "stage": U32, "input": BAD_TENSOR, "past_length": NEAR,
    "start_position": NEAR, "hide_slots": HIDE_SLOTS, "route": ROUTES,
    "top_k": st.one_of(st.sampled_from([0, 1, 256, 257]), U32),
    "logits_count": st.one_of(st.sampled_from(["seq", "seq+1", 0]), U32), "reply_to": st.sampled_from(["", "nobody"]),
    "manifest_sha256": st.sampled_from(["", "0" * 64, "not a sha", "é" * 40]),
    "row_start_positions": st.lists(NEAR, min_size=1, max_size=4), "row_pads": ROWS, "hide_rows": ROWS,
    "keep_rows": ROWS,
}
COMPACT_BAD = {"session_id": SESSION, "past_length": NEAR, "hide_slots": HIDE_SLOTS, "hide_rows": ROWS,
               "manifest_sha256": FORWARD_BAD["manifest_sha256"]}
MERGE_BAD = {"session_id": SESSION, "sources": st.lists(SESSION, max_size=5), "max_context": NEAR,
             "manifest_sha256": FORWARD_BAD["manifest_sha256"]}
OPEN_BAD = {"session_id": SESSION, "max_context": U32, "manifest_sha256": FORWARD_BAD["manifest_sha256"]}
BREAKS = {name: st.sets(st.sampled_from(sorted(bad)), min_size=1, max_size=3)
          for name, bad in (("Forward", FORWARD_BAD), ("Compact", COMPACT_BAD), ("Merge", MERGE_BAD),
                            ("OpenSession", OPEN_BAD))}
SEQ = st.integers(1, 4)
KINDS = st.sampled_from(["Forward"] * 8 + ["Compact"] * 2 + ["Merge"] * 2 + ["OpenSession", "Subscribe"])
THROW = st.sampled_from(["structured"] * 4 + ["garbage", "mangled"])
PATHS = st.sampled_from([SERVICE + name for name in [*UNARY, "Subscribe"]] + UNKNOWN_PATHS)
MANGLE = st.lists(st.tuples(st.sampled_from(["cut", "flip", "insert"]), st.integers(0, 2**16), st.integers(0, 255),
                            st.binary(min_size=1, max_size=8)), min_size=1, max_size=3)


@dataclass
class Session:
    length: int = 0
    rows: int = 1


@dataclass
class WorkerFuzz:
    """Throws messages at one worker and checks every answer; keeps a model of the sessions it holds
    (so most messages are valid but for one or two fields and reach the deep checks)."""

    address: str
    stage: int
    last: bool
    hidden: int
    vocab: int
    sha: str
    route: list[str]
    codes: Counter = field(default_factory=Counter)
    sessions: dict[str, Session] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)  # every session id a message may have created
    setting_up: bool = False  # the valid calls around the fuzz are not counted

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address, options=BIG_CHANNEL)
        self.unary = {name: self.channel.unary_unary(SERVICE + name) for name in UNARY}
        self._subscribe = self.channel.unary_stream(SERVICE + "Subscribe")

    @property
    def thrown(self) -> int:
        return sum(self.codes.values())

    @property
    def rejected(self) -> int:
        return self.thrown - self.codes[grpc.StatusCode.OK.name]

    def close(self) -> None:
        self.channel.close()

    # -- sending -----------------------------------------------------------------------------
    def _check(self, code: grpc.StatusCode, details: str | None, path: str, what: object) -> None:
        """Count the answer to ``what`` (a message or raw bytes) and check it is a clean one."""
        if not self.setting_up:
            self.codes[code.name] += 1
        clean = code in CLEAN_CODES and (code == grpc.StatusCode.OK or (
            details and not details.startswith("Unexpected <class")  # gRPC's words for an unhandled exception
            and not details.startswith("Stream removed")))  # the answer was lost (e.g. a status message > 16 KiB)
        # a stage 0 chunk routed to a well-formed address where nothing listens: the next hop's failure, named
        clean = clean or (code == grpc.StatusCode.UNAVAILABLE and not self.last and details.startswith("stage 1 at "))
        assert clean, f"{path} {_short(what)}: {code.name} {details!r}"

    def call(self, path: str, payload: bytes, what: object = None) -> bytes | None:
        """Send raw ``payload`` to ``path`` (unary); the reply bytes when OK, else None (status checked).
        ``what`` (shown when the check fails) defaults to the payload."""
        what = payload if what is None else what
        name = path.removeprefix(SERVICE)
        if name == "Subscribe":
            return self.subscribe(payload, what)
        method = self.unary.get(name) if path.startswith(SERVICE) else None
        method = method or self.channel.unary_unary(path)
        try:
            reply = method(payload, timeout=DEADLINE_S)
        except grpc.RpcError as exc:
            self._check(exc.code(), exc.details(), path, what)
            return None
        self._check(grpc.StatusCode.OK, None, path, what)
        return reply

    def subscribe(self, payload: bytes, what: object) -> bytes | None:
        """Open a result stream with raw ``payload``, read its handshake, hang up."""
        call = self._subscribe(payload, timeout=DEADLINE_S)
        try:
            first = next(call)
        except grpc.RpcError as exc:
            self._check(exc.code(), exc.details(), SERVICE + "Subscribe", what)
            return None
        finally:
            call.cancel()
        self._check(grpc.StatusCode.OK, None, SERVICE + "Subscribe", what)
        return first

    def send(self, name: str, message) -> bytes | None:  # noqa: ANN001
        """Send a structured message and update the session model from a successful reply."""
        if name in ("OpenSession", "Merge") and message.session_id:
            self.touched.add(message.session_id)
        reply = self.call(SERVICE + name, message.SerializeToString(), message)
        if reply is None:
            return None
        if name == "OpenSession":
            self.sessions[message.session_id] = Session()
        elif name == "CloseSession":
            self.sessions.pop(message.session_id, None)
        elif name == "Forward" and message.session_id in self.sessions:
            s = self.sessions[message.session_id]
            s.length += message.input.shape[1]
            s.rows = message.input.shape[0]
        elif name == "Compact" and message.session_id in self.sessions:
            self.sessions[message.session_id].length = pb.CompactReply.FromString(reply).length
        elif name == "Merge":
            for source in message.sources:
                self.sessions.pop(source, None)
            merged = pb.MergeReply.FromString(reply)
            self.sessions[message.session_id] = Session(merged.length, merged.rows)
        return reply

    def valid(self, name: str, message) -> bytes:  # noqa: ANN001
        """Send a valid message (not counted); it must succeed."""
        self.setting_up = True
        try:
            reply = self.send(name, message)
        finally:
            self.setting_up = False
        assert reply is not None, f"{name} failed"
        return reply

    def garbage(self, path: str, payload: bytes) -> None:
        """Raw bytes to ``path``; a session they happen to open or name is remembered for cleanup."""
        for kind in (pb.OpenSessionRequest, pb.MergeRequest):
            if path == SERVICE + kind.DESCRIPTOR.name.removesuffix("Request"):
                try:
                    self.touched.add(kind.FromString(payload).session_id)
                except Exception:  # noqa: BLE001  (does not parse here either: nothing to clean up)
                    pass
        self.call(path, payload)

    def info(self) -> pb.InfoReply:
        return pb.InfoReply.FromString(self.unary["Info"](b"", timeout=DEADLINE_S))

    def close_all(self, *others: WorkerFuzz) -> None:
        """Close every session any message may have created, here and on ``others`` (where a stage
        0 forward may have gone); the model forgets them."""
        for fuzz in (self, *others):
            for sid in self.touched | set(self.sessions):
                fuzz.unary["CloseSession"](pb.CloseSessionRequest(session_id=sid).SerializeToString(),
                                            timeout=DEADLINE_S)
        self.touched.clear()
        self.sessions.clear()

    # -- structured messages --------------------------------------------------------------------
    def session_id(self, value: object) -> str:
        """A session id from ``SESSION``: another live session (``Live``), or an odd id."""
        live = sorted(self.sessions)
        if isinstance(value, Live):
            return live[value.index % len(live)] if live else "fz-none"
        return value

    def _broken(self, draw, name: str) -> dict:  # noqa: ANN001
        """Bad values for one to three fields of a ``name`` message (the others stay right)."""
        bad = {"Forward": FORWARD_BAD, "Compact": COMPACT_BAD, "Merge": MERGE_BAD, "OpenSession": OPEN_BAD}[name]
        broken = {key: draw(bad[key]) for key in sorted(draw(BREAKS[name]))}
        if name == "Forward" and "route" in broken and self.last:  # the last stage ignores the route
            broken["stage"] = draw(U32)
        return broken

    def tensor(self, bad: tuple | None, rows: int, seq: int) -> pb.Tensor:
        """This stage's input for ``rows`` x ``seq`` tokens, broken as ``bad`` (from ``BAD_TENSOR``) says."""
        kind, arg = bad or (None, None)
        if kind == "shape":
            shape, dtype, data = arg
            return pb.Tensor(data=data, shape=shape, dtype=dtype)
        rows = arg if kind == "rows" else rows
        seq = arg if kind == "seq" else seq
        rng = np.random.default_rng(seq)
        if self.stage == 0:
            x = rng.integers(0, self.vocab, size=(rows, seq), dtype=np.int64)
        else:
            width = {None: self.hidden, 0: 0, 1: 1, -1: self.hidden - 1, +1: self.hidden + 1}[
                arg if kind == "width" else None]
            x = rng.standard_normal((rows, seq, width), dtype=np.float32)
        if kind == "value" and x.size:  # a token id outside the vocabulary; NaN, infinity or 3e38 in hidden states
            at, which = arg
            odd = {"low": -1, "high": self.vocab, "huge": 2**62} if self.stage == 0 else {
                "low": np.nan, "high": np.inf, "huge": 3e38}
            x.flat[at % x.size] = odd[which]
        if kind == "ndim":
            x = x.reshape((x.size,) + (1,) * (arg - 1))
        data, dtype = x.tobytes(), x.dtype.name
        if kind == "dtype":
            dtype = arg
        elif kind == "bytes":
            data = data[:arg] if arg < 0 else data + bytes(arg)
        return pb.Tensor(data=data, shape=list(x.shape), dtype=dtype)

    def forward(self, draw) -> pb.ForwardRequest:  # noqa: ANN001
        bad = self._broken(draw, "Forward")
        sid = self.session_id(bad.get("session_id", Live(0)))
        s = self.sessions.get(sid, Session())
        seq = draw(SEQ)
        logits = bad.get("logits_count", 1)
        return pb.ForwardRequest(
            session_id=sid, step_id=1, stage=bad.get("stage", self.stage),
            input=self.tensor(bad.get("input"), s.rows, seq),
            past_length=near(bad.get("past_length", Near(0)), s.length),
            start_position=near(bad.get("start_position", Near(0)), s.length),
            hide_slots=bad.get("hide_slots", []), route=bad.get("route", self.route),
            logits_count={"seq": seq, "seq+1": seq + 1}.get(logits, logits), top_k=bad.get("top_k", 8),
            reply_to=bad.get("reply_to", SUBSCRIBER), manifest_sha256=bad.get("manifest_sha256", self.sha),
            row_start_positions=[near(v, s.length) for v in bad.get("row_start_positions", [])],
            row_pads=bad.get("row_pads", []), hide_rows=bad.get("hide_rows", []), keep_rows=bad.get("keep_rows", []),
        )

    def message(self, draw) -> tuple[str, object]:  # noqa: ANN001
        """One structured message (its RPC name and the message), valid but for one to three fields."""
        name = draw(KINDS)
        if name == "Forward":
            return name, self.forward(draw)
        if name == "Compact":
            bad = self._broken(draw, name)
            sid = self.session_id(bad.get("session_id", Live(0)))
            s = self.sessions.get(sid, Session())
            return name, pb.CompactRequest(
                session_id=sid, past_length=near(bad.get("past_length", Near(0)), s.length),
                hide_slots=bad.get("hide_slots", []), hide_rows=bad.get("hide_rows", []),
                manifest_sha256=bad.get("manifest_sha256", self.sha))
        if name == "Merge":
            bad = self._broken(draw, name)
            sources = [self.session_id(x) for x in bad.get("sources", sorted(self.sessions))]
            longest = max((self.sessions[x].length for x in sources if x in self.sessions), default=0)
            return name, pb.MergeRequest(session_id=self.session_id(bad.get("session_id", "fz-group")), sources=sources,
                                         max_context=near(bad.get("max_context", Near(0)), longest),
                                         manifest_sha256=bad.get("manifest_sha256", self.sha))
        if name == "OpenSession":
            bad = self._broken(draw, name)
            return name, pb.OpenSessionRequest(session_id=self.session_id(bad.get("session_id", "fz-other")),
                                               max_context=bad.get("max_context", 64),
                                               manifest_sha256=bad.get("manifest_sha256", self.sha))
        subscriber = draw(ODD_IDS)  # never this test's own stream: a second one would take its place
        return name, pb.SubscribeRequest(subscriber_id=subscriber if subscriber != SUBSCRIBER else "x")

    def throw_one(self, draw) -> None:  # noqa: ANN001
        """One malformed message: structured, raw garbage, or a structured one with bytes mangled."""
        kind = draw(THROW)
        if kind == "structured":
            self.send(*self.message(draw))
        elif kind == "garbage":
            self.garbage(draw(PATHS), draw(GARBAGE))
        else:
            name, message = self.message(draw)
            if name == "Forward" and not self.last:
                # never forwarded: mangled digits of the next stage's port could name another test's worker
                message.session_id, message.route[:] = "fz-none", [UNREACHABLE]
            payload = bytearray(message.SerializeToString())
            for op, at, byte, insert in draw(MANGLE):
                at %= len(payload) + 1
                if op == "cut":
                    payload = payload[:at]
                elif op == "flip" and at < len(payload):
                    payload[at] = byte
                else:
                    payload[at:at] = insert
            self.garbage(SERVICE + name, bytes(payload))


def _short(what: object) -> str:
    """``what`` (raw bytes or a message, tensor bytes left out) for a failure message."""
    if isinstance(what, bytes):
        return repr(what[:300])
    if isinstance(what, pb.ForwardRequest):
        shown = pb.ForwardRequest()
        shown.CopyFrom(what)
        shown.input.data = b"<%d bytes>" % len(what.input.data)
        del shown.hide_slots[64:]
        what = shown
    return str(what).replace("\n", " ")[:2000]


class Results:
    """This test's result stream from the last stage (the coordinator's role): a thread reads it."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=BIG_CHANNEL)
        self.call = self.channel.unary_stream(SERVICE + "Subscribe", response_deserializer=pb.StepResult.FromString)(
            pb.SubscribeRequest(subscriber_id=SUBSCRIBER).SerializeToString())
        self.results: queue.Queue = queue.Queue()
        next(self.call)  # the handshake: subscribed
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for result in self.call:
                self.results.put(result)
        except grpc.RpcError:
            pass

    def wait(self, session_id: str, step_id: int) -> pb.StepResult:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            result = self.results.get(timeout=10)
            if result.session_id == session_id and result.step_id == step_id:
                return result
        raise TimeoutError(f"no result for {session_id} step {step_id}")

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=10)
        self.channel.close()



def fuzzers(build: Path, stages) -> tuple[WorkerFuzz, WorkerFuzz]:  # noqa: ANN001
    (_, address0), (_, address1), _ = stages
    loaded = load_manifest(build)
    arch = loaded.manifest.architecture
    common = dict(hidden=arch.hidden_size, vocab=arch.vocab_size, sha=loaded.sha256)
    return (WorkerFuzz(address0, 0, False, route=[address1], **common),
            WorkerFuzz(address1, 1, True, route=[], **common))


def reference_step(fuzz: WorkerFuzz, results: Results, *others: WorkerFuzz) -> tuple[np.ndarray, np.ndarray]:
    """A valid 4-token chunk through a fresh session from ``fuzz``'s stage to the last one: the top-8
    ids and logprobs, bit-exact from run to run (f32)."""
    sid, step = f"fz-reference-{fuzz.stage}", 7777
    for each in (fuzz, *others):
        each.valid("OpenSession", pb.OpenSessionRequest(session_id=sid, max_context=64))
    rng = np.random.default_rng(0)
    x = (rng.integers(0, fuzz.vocab, (1, 4)) if fuzz.stage == 0 else
         rng.standard_normal((1, 4, fuzz.hidden), dtype=np.float32))
    fuzz.valid("Forward", pb.ForwardRequest(session_id=sid, step_id=step, stage=fuzz.stage, input=to_tensor(x),
                                            route=fuzz.route, logits_count=1, top_k=8, reply_to=SUBSCRIBER,
                                            manifest_sha256=fuzz.sha))
    result = results.wait(sid, step)
    fuzz.close_all(*others)
    return from_tensor(result.top_ids).copy(), from_tensor(result.top_logprobs).copy()


def warm_up(fuzz: WorkerFuzz, others: tuple[WorkerFuzz, ...]) -> None:
    """Valid chunks of every shape the fuzz can make run (batch groups of 1 to 4 rows, 1 to 4 tokens,
    logits for all of them): OpenVINO keeps buffers sized for the largest shape it has met (measured:
    +78 MiB at the first 2-row chunk), which is a cache, not a leak."""
    for rows in range(1, 5):
        names = [f"fz-warm-{i}" for i in range(rows)]
        for each in (fuzz, *others):
            for sid in names:
                each.valid("OpenSession", pb.OpenSessionRequest(session_id=sid, max_context=64))
            each.valid("Merge", pb.MergeRequest(session_id="fz-warm", sources=names, max_context=64))
        past = 0
        for seq in range(1, 5):
            x = (np.ones((rows, seq), np.int64) if fuzz.stage == 0 else np.ones((rows, seq, fuzz.hidden), np.float32))
            fuzz.valid("Forward", pb.ForwardRequest(session_id="fz-warm", stage=fuzz.stage, input=to_tensor(x),
                                                    past_length=past, start_position=past, route=fuzz.route,
                                                    logits_count=seq, top_k=8, reply_to=SUBSCRIBER,
                                                    manifest_sha256=fuzz.sha))
            past += seq
        fuzz.touched.add("fz-warm")
        fuzz.close_all(*others)


def run_fuzz(fuzz: WorkerFuzz, others: tuple[WorkerFuzz, ...], examples: int, per_example: int) -> None:
    """``examples`` hypothesis examples of ``per_example`` messages each, every one from fresh
    sessions (opened, and given a few tokens, validly); every session is closed after each example
    and the workers must then hold none."""

    @settings(FUZZ, max_examples=examples)
    @given(st.data())
    def throw(data: st.DataObject) -> None:
        try:  # the cleanup also runs when hypothesis stops an example midway (too much data drawn)
            for sid, tokens in (("fz-main", 3), ("fz-side", 1)):
                for each in (fuzz, *others):
                    each.valid("OpenSession", pb.OpenSessionRequest(session_id=sid, max_context=256))
                x = (np.arange(tokens, dtype=np.int64)[None] if fuzz.stage == 0 else
                     np.ones((1, tokens, fuzz.hidden), np.float32))
                fuzz.valid("Forward", pb.ForwardRequest(session_id=sid, stage=fuzz.stage, input=to_tensor(x),
                                                        route=fuzz.route, manifest_sha256=fuzz.sha))
            for _ in range(per_example):
                fuzz.throw_one(data.draw)
        finally:
            fuzz.close_all(*others)
        for each in (fuzz, *others):
            info = each.info()
            held = (info.sessions, info.kv_bytes, info.kv_reserved_bytes)
            assert held == (0, 0, 0), f"stage {each.stage} leaks: {info}"

    throw()


CHAT = "/v1/chat/completions"


def valid_chat(client: httpx.Client, **kw) -> dict:  # noqa: ANN003
    """A valid chat request; must succeed."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, **kw}
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def worker_sessions(*addresses: str) -> list[int]:
    """Sessions (KV states) each worker holds, from its Info."""
    out = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            reply = channel.unary_unary(SERVICE + "Info")(b"", timeout=DEADLINE_S)
            out.append(pb.InfoReply.FromString(reply).sessions)
    return out
