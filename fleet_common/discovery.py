"""What a worker announces over zeroconf (TXT record) and how the coordinator reads it back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerAd:
    """A worker's advertisement: enough to place it in a pipeline and to refuse a mismatched one."""

    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    manifest_sha256: str
    protocol_version: int
    model_id: str
    worker_id: str
    port: int
    host: str = ""  # filled in by the browser from the DNS A record

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def encode_txt(ad: WorkerAd) -> dict[str, str]:
    """TXT properties for ``ad`` (all strings; mDNS TXT values are short byte strings)."""
    return {
        "stage": str(ad.stage),
        "stages": str(ad.num_stages),
        "layers": f"{ad.layer_start}:{ad.layer_end}",
        "manifest": ad.manifest_sha256,
        "proto": str(ad.protocol_version),
        "model": ad.model_id[:120],
        "id": ad.worker_id,
    }


def decode_txt(props: dict[bytes, bytes | None], host: str, port: int) -> WorkerAd:
    """Parse TXT properties back into a ``WorkerAd``; raises ``ValueError`` when fields are missing or bad."""
    try:
        p = {k.decode(): (v or b"").decode() for k, v in props.items()}
        start, end = (int(x) for x in p["layers"].split(":"))
        return WorkerAd(
            stage=int(p["stage"]),
            num_stages=int(p["stages"]),
            layer_start=start,
            layer_end=end,
            manifest_sha256=p["manifest"],
            protocol_version=int(p["proto"]),
            model_id=p.get("model", ""),
            worker_id=p.get("id", ""),
            port=port,
            host=host,
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"bad fleet TXT record from {host}:{port}: {exc!r}") from exc
