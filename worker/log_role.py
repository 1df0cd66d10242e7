"""The role a worker's log lines name (``worker[1]``, ``worker[empty]``): an empty worker's changes to the stage
it serves once one is loaded (worker/stage_slot.py ``LoadStage``), so its lines no longer say ``empty``."""

from __future__ import annotations

import logging

_role = ["?"]


def set_role(role: str) -> None:
    """Name this worker ``role`` in its log lines from now on (a stage index, or ``empty``)."""
    _role[0] = role


class RoleFilter(logging.Filter):
    """Gives every record ``worker_role``, the role set last (``%(worker_role)s`` in the log format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keeps the record; sets its ``worker_role``."""
        record.worker_role = _role[0]
        return True
