"""Coordinator settings: one pydantic-settings class; the ``serve`` CLI is generated from it. The security flags
(``--secret``, ``--tls-*``) come from ``fleet_common.settings.SecuritySettings``, as the worker's do."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_common.settings import SecuritySettings


class CoordinatorSettings(SecuritySettings, BaseSettings):
    """How ``fleet-coordinator serve`` finds workers, runs requests and serves HTTP."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", cli_kebab_case=True, cli_implicit_flags=True)

    model: Path = Field(description="build folder written by fleet-compiler build (manifest, tokenizer), an "
                        "HF folder or a .gguf file: then the coordinator plans, builds and ships it over empty workers "
                        "(--peer, else found by mDNS)")
    host: str = Field("127.0.0.1", description="HTTP bind address; 0.0.0.0 serves the LAN")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    expect_workers: int = Field(0, ge=0, description="--model SOURCE (an HF folder or a .gguf, not a build): plan, "
                                "build and ship over this many empty workers (0 = as many --peer as given; by "
                                "mDNS: all that answer until none is new for 5 s)")
    workers_timeout_s: float = Field(120.0, gt=0, description="longest wait for the expected empty workers")
    replan_wait_s: float = Field(600.0, gt=0, description="--model SOURCE: longest a request waits while the fleet "
                                 "re-plans over the workers left (a stage lost its last worker)")
    build_cache_dir: Path | None = Field(None, description="where builds of a SOURCE are cached (default "
                                         "$XDG_CACHE_HOME/fleet/coordinator)")
    peer: list[str] = Field(default_factory=list, description="worker host:port to use without mDNS (repeatable)")
    discover: bool = Field(True, description="browse zeroconf (mDNS) for workers")
    announce: bool = Field(True, description="announce the HTTP API with zeroconf for fleet-chat")
    local_workers: int = Field(0, ge=0, le=64, description="start this many workers here, one per stage (0 = none)")
    worker_threads: int = Field(0, ge=0, description="inference threads of each local worker (0 = default)")
    inference_precision: Literal["auto", "f32", "bf16", "f16"] = Field(
        "auto", description="precision hint passed to local workers: f32 makes greedy answers token-identical "
        "alone, batched and after a failover (about 2x slower); auto (bf16 where the CPU has it) does not "
        "(see docs/precision.md)")
    served_model_name: str = Field("", description="model name in the API; empty = the build's model id")
    max_tokens_default: int = Field(512, ge=1, description="max_tokens when a request gives none")
    max_context: int = Field(0, ge=0, description="cap on prompt + completion tokens (0 = the model's context)")
    prefill_chunk: int = Field(64, ge=1, le=4096, description="prompt tokens per pipeline step during prefill (small "
                               "chunks let other users' decode steps in between: measured, a 1,800-token prompt "
                               "stalls decoders up to 0.9 s at 64, 3.0 s at 256, for the same TTFT)")
    sample_top_k: int = Field(64, ge=1, le=256, description="candidates the last stage returns per position when sampling")
    max_concurrent_requests: int = Field(32, ge=1, description="requests generating at once; more wait in the queue")
    max_queued_requests: int = Field(64, ge=0, description="requests waiting for a slot or for KV room on the "
                                     "stages; more get HTTP 429")
    queue_timeout_s: float = Field(60.0, gt=0, description="longest wait in the queue before HTTP 429")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of one pipeline step, plus per_token_timeout_s per token")
    per_token_timeout_s: float = Field(0.05, ge=0, description="extra step deadline per token in the chunk per stage")
    health_interval_s: float = Field(1.0, gt=0, description="seconds between health checks of each worker")
    missed_health_checks: int = Field(3, ge=1, description="a worker late for this many checks in a row is "
                                      "gone (one refusing or resetting the connection is gone at once)")
    draft: str = Field(
        "auto", description="speculative decoding draft: a draft model of the build by name (e.g. self-int4, see "
        "fleet-compiler build --draft), ngram (prompt lookup in the session's own context), none, or auto "
        "(the build's first draft model, else none)")
    draft_threads: int = Field(0, ge=0, description="inference threads of the draft model (0 = default)")
    spec_k: int = Field(0, ge=0, le=16, description="draft tokens per step with --draft; 0 = adaptive (per session, "
                        "from its acceptance rate and the measured step times)")
    spec_k_max: int = Field(8, ge=1, le=16, description="largest K the adaptive choice may pick")
    spec_slack: int = Field(512, ge=0, description="extra KV slots per session for rejected drafts (kept, masked)")
    compact_share: float = Field(0.5, gt=0, le=1, description="compact a session's KV (one state rewrite per stage) "
                                 "when invisible slots of rejected drafts reach this share of its slots ...")
    compact_min_slots: int = Field(64, ge=1, description="... and at least this many slots (or when it is full)")
    max_batch: int = Field(8, ge=1, le=64, description="sessions decoding together in one infer call per stage "
                           "(a batch group); 1 = no batching")
    batch_groups: int = Field(0, ge=0, le=64, description="batch groups in flight, interleaved across the stages "
                              "(0 = one per stage; measured better than one more at 2-4 users); more are opened "
                              "only when all are full")
    prefix_cache: bool = Field(True, description="keep a finished request's KV on the stages and prefill only what a "
                               "new prompt adds to it (the next turn of a chat)")
    prefix_cache_tokens: int = Field(16384, ge=0, description="bound on the tokens all retained sessions hold "
                                     "together (least recently used evicted first; the workers' KV budgets bound "
                                     "them too)")
    prefix_cache_min_tokens: int = Field(16, ge=1, description="shortest common prefix worth reusing")
    prefix_cache_idle_s: float = Field(300.0, gt=0, description="a retained session unused this long is freed")
    grammar_check_s: float = Field(1.0, gt=0, le=60, description="CPU seconds a request's JSON schemas and grammars "
                                   "(response_format, guided_*, a tool's parameters, Ollama's format) may take to "
                                   "compile and start decoding, tried in a process of their own (10x that in wall "
                                   "time); longer is HTTP 400 (llguidance's compile time can grow exponentially with "
                                   "a small schema)")
    grammar_check_mb: int = Field(512, ge=64, description="memory (MiB) that trial may take beyond its tokenizer; "
                                  "more is HTTP 400")
    failover_attempts: int = Field(2, ge=0, le=16, description="times a request moves to replica workers after a "
                                   "stage fails mid-generation (its KV rebuilt from its tokens); 0 = fail at once")
    api_key_file: Path | None = Field(None, description="file of HTTP API keys, one per line ('#' comments): /v1/*, "
                                      "/metrics and /openapi.json then require 'Authorization: Bearer KEY' (/health "
                                      "stays open without the workers: see --public-health, --public-metrics)")
    api_keys: SecretStr = Field(SecretStr(""), description="comma-separated HTTP API keys, added to --api-key-file's; "
                                "better set as FLEET_API_KEYS in the environment (a command line is visible to "
                                "other users of this machine)")
    allowed_host: list[str] = Field(default_factory=list, description="also answer requests whose Host header is "
                                    "this name (repeatable; '*.example.com': its subdomains; '*': any). Without "
                                    "it: IP addresses, localhost and this machine's names; other names get HTTP "
                                    "400 (a guard against DNS rebinding)")
    public_health: bool = Field(False, description="with API keys: /health shows callers without a key the "
                                "workers too (addresses, load, KV); else only ready, the model, the stages "
                                "missing and the request counts")
    public_metrics: bool = Field(False, description="with API keys: /metrics (which names every worker's "
                                 "address) needs no key")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a request's complete headers "
                                    "within this many seconds of opening (or of its next request's first byte)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request's body must arrive within this many seconds "
                                  "of its headers")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle connection is closed this many seconds "
                                        "after its last answer")
    max_connections_per_client: int = Field(64, ge=0, description="connections one client address may hold open at "
                                            "once; more are refused with HTTP 429 (0 = no cap)")
    shutdown_grace_s: float = Field(3.0, ge=0, description="on Ctrl-C or SIGTERM, seconds the answers in flight get "
                                    "to finish before they are ended with an error saying the coordinator is "
                                    "shutting down (a second Ctrl-C ends them at once)")
    log_level: str = Field("INFO", description="logging level")

    _api_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _load_api_keys(self) -> CoordinatorSettings:
        keys = [k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip()]
        if self.api_key_file is not None:
            keys += read_api_keys(self.api_key_file)
        self._api_keys = tuple(dict.fromkeys(keys))
        return self

    @property
    def allowed_api_keys(self) -> tuple[str, ...]:
        """The HTTP API keys from ``--api-key-file`` and ``--api-keys``; empty = the API is open."""
        return self._api_keys

    @field_validator("peer")
    @classmethod
    def _peers_are_host_port(cls, peers: list[str]) -> list[str]:
        for peer in peers:
            host, _, port = peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"peer {peer!r} is not host:port")
        return peers


def read_api_keys(path: Path) -> list[str]:
    """The API keys in ``path``: one per line, blank lines and ``#`` comments skipped. Raises
    ``ValueError`` when the file cannot be read or holds no key."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it: {exc}") from exc
    keys = [k for k in (line.split("#", 1)[0].strip() for line in lines) if k]
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in it (one per line, '#' starts a comment)")
    return keys
