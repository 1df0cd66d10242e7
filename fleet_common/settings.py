"""What the settings of every role that speaks gRPC share: the fleet's secret and TLS files (``--secret``,
``--tls-cert``, ``--tls-key``, ``--tls-ca``), read and checked once when the settings are validated; and
``cache_home``, the folder every role's caches default to."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from .security import Security, SecurityError


def cache_home(name: str) -> Path:
    """``$XDG_CACHE_HOME/fleet/<name>``, else (unset or empty) ``~/.cache/fleet/<name>``: the default of the
    worker's OpenVINO model cache and stage cache and of the coordinator's build cache. Creates nothing."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleet" / name


class SecuritySettings(BaseModel):
    """Mixin of a role's pydantic settings (``class WorkerSettings(SecuritySettings, BaseSettings)``): the
    four security fields and ``security``, the ``Security`` loaded from them (a ``ValueError`` at validation
    when a file cannot be used: ``SecurityError``'s message)."""

    secret: Path | None = Field(None, description="file holding the fleet's shared key (stripped): every gRPC call "
                                "then carries an HMAC token made with it, which the worker checks (give every role "
                                "the same file; a coordinator's local workers get it too)")
    tls_cert: Path | None = Field(None, description="PEM certificate of this process, which turns TLS on: a worker "
                                  "serves TLS with it, and every role presents it when it calls a worker. It must "
                                  "name the host or IP the others dial (127.0.0.1 for a coordinator's local "
                                  "workers, which serve it)")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert (unencrypted)")
    tls_ca: Path | None = Field(None, description="PEM CA certificate that signed the fleet's certificates: the "
                                "workers' are checked against it (without it: the system's roots), and workers "
                                "require callers to present one it signed (mutual TLS)")

    _security: Security = PrivateAttr(default_factory=Security)

    @model_validator(mode="after")
    def _load_security(self) -> SecuritySettings:
        try:
            self._security = Security.load(self.secret, self.tls_cert, self.tls_key, self.tls_ca)
        except SecurityError as exc:
            raise ValueError(str(exc)) from exc
        return self

    @property
    def security(self) -> Security:
        """The secret and TLS material read from ``--secret``/``--tls-*`` (checked at validation)."""
        return self._security
