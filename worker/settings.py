"""Worker settings: one pydantic-settings class; the CLI is generated from it (env prefix ``FLEET_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    """fleet-worker: serve one shard of a fleet-compiler build over gRPC and announce it with zeroconf."""

    model_config = SettingsConfigDict(env_prefix="FLEET_", cli_kebab_case=True, cli_implicit_flags=True)

    shard: int = Field(ge=0, description="stage index this worker serves (0 = first); required")
    model: Path = Field(description="build folder written by fleet-compiler build (holds manifest.json)")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 serves the LAN")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one")
    device: str = Field("CPU", description="OpenVINO device: CPU, GPU, NPU")
    threads: int = Field(0, ge=0, le=256, description="inference threads; 0 = OpenVINO's default")
    inference_precision: Literal["auto", "f32", "bf16", "f16"] = Field(
        "auto", description="INFERENCE_PRECISION_HINT; f32 also forces f32 KV (bit-exact with a one-device run)"
    )
    max_sessions: int = Field(64, ge=1, le=4096, description="sessions held at once; more get RESOURCE_EXHAUSTED")
    max_context: int = Field(0, ge=0, description="cap on physical KV slots per session; 0 = the model's context")
    kv_budget_mb: int = Field(0, ge=0, description="KV cache memory sessions may reserve (each for its max context); "
                              "more get RESOURCE_EXHAUSTED; 0 = half of the memory available at start")
    idle_timeout_s: float = Field(600.0, gt=0, description="a session unused this long is dropped and its KV freed")
    announce: bool = Field(True, description="announce this worker with zeroconf (mDNS)")
    verify_hashes: bool = Field(True, description="sha256-check the shard files against the manifest at start")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (same host); "
                              "0 = off")
    log_level: str = Field("INFO", description="logging level")
