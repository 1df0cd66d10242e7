"""Worker settings: one pydantic-settings class; the CLI is generated from it (env prefix ``FLEET_``). The
security flags (``--secret``, ``--tls-*``) come from ``fleet_common.settings.SecuritySettings``, as the
coordinator's do."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet_common.settings import SecuritySettings


class WorkerSettings(SecuritySettings, BaseSettings):
    """fleet-worker: serve a shard over gRPC, announced by zeroconf; --profile: time a layer for fleet-compiler plan."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", cli_kebab_case=True, cli_implicit_flags=True)

    shard: int | None = Field(None, ge=0, description="stage index this worker serves (0 = first); without --shard "
                              "and --model the worker starts empty and is shipped its stage (StageStore)")
    model: Path | None = Field(None, description="build folder written by fleet-compiler build (holds manifest.json)")
    stages_dir: Path | None = Field(None, description="an empty worker's stage cache (the stages shipped to it); "
                                    "default $XDG_CACHE_HOME/fleet/stages (~/.cache/fleet/stages)")
    stages_max_gb: float = Field(64.0, gt=0, description="an empty worker's stage cache is kept under this size: "
                                 "the builds least recently used are deleted first (never the one it serves)")
    open_store: bool = Field(False, description="an empty worker bound beyond loopback (--host 0.0.0.0) without "
                             "--secret takes stages from any host that reaches its port: only on a network you "
                             "trust (without it, such a worker refuses to start; give it --secret FILE instead)")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 serves the LAN")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one")
    device: str = Field("CPU", description="OpenVINO device: CPU, GPU, NPU")
    threads: int = Field(0, ge=0, le=256, description="inference threads; 0 = OpenVINO's default (at bf16 more "
                         "than one makes a step's rounding depend on its rows and length)")
    inference_precision: Literal["auto", "f32", "bf16", "f16"] = Field(
        "auto", description="INFERENCE_PRECISION_HINT. auto: OpenVINO's choice, bf16 with an f16 KV cache on a CPU "
        "with bf16: greedy answers may then differ between a request alone and batched, after a failover or "
        "with the prefix cache (at near-ties; see docs/precision.md). f32 (also f32 KV): token-identical in all "
        "of these, about 2x slower"
    )
    max_sessions: int = Field(64, ge=1, le=4096, description="sessions held at once; more get RESOURCE_EXHAUSTED")
    max_context: int = Field(0, ge=0, description="cap on physical KV slots per session; 0 = the model's context")
    kv_budget_mb: int = Field(0, ge=0, description="KV cache memory sessions may reserve (each for its max context); "
                              "more get RESOURCE_EXHAUSTED; 0 = half of the memory available at start, at most what "
                              "--memory-mb leaves beside the loaded stage")
    memory_mb: int = Field(0, ge=0, description="memory an empty worker offers a planning coordinator (MiB): it "
                           "announces at most this (a PC that keeps memory for other work), and its stage's weights "
                           "and KV budget stay within it; 0 = the memory available at its start (MemAvailable)")
    idle_timeout_s: float = Field(600.0, gt=0, description="a session unused this long is dropped and its KV freed")
    owner_timeout_s: float = Field(30.0, gt=0, description="the sessions of a coordinator that has not health-checked "
                                   "this worker for this long are dropped (it died; its KV is freed)")
    announce: bool = Field(True, description="announce this worker with zeroconf (mDNS)")
    advertise_addr: list[str] = Field(default_factory=list, description="address to announce (repeatable; default: "
                                      "every address of --host's interfaces, the coordinator uses the first that "
                                      "answers): the one the coordinator routes to, on a PC with a VPN, docker0 or "
                                      "a second subnet, or a NAT's address")
    verify_hashes: bool = Field(True, description="sha256-check the shard files against the manifest at start")
    blobs: bool = Field(True, description="import the build's pre-compiled blob of this shard (fleet-compiler "
                        "precompile) when it was made for this device, OpenVINO version and config")
    model_cache: bool = Field(True, description="otherwise compile the IR through OpenVINO's model cache, so the "
                              "next start on this machine imports it")
    cache_dir: Path | None = Field(None, description="model cache folder; default $XDG_CACHE_HOME/fleet/openvino "
                                   "(~/.cache/fleet/openvino)")
    cache_max_gb: float = Field(8.0, gt=0, description="the model cache is kept under this size: the least recently "
                                "loaded shards' entries are deleted first")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (same host); "
                              "0 = off")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _static_or_empty(self) -> WorkerSettings:
        if (self.shard is None) != (self.model is None):
            raise ValueError("--shard and --model go together (a static worker); give neither for an empty worker")
        return self

