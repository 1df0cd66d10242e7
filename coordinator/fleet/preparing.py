"""What ``serve --model SOURCE`` is doing while it prepares its fleet (issue 30): collecting the empty workers,
planning, building and shipping take from seconds to minutes (a 1B model over 100 Mbit/s: about 100 s), and the
API cannot serve before there is a build. ``Preparation`` holds the phase, its progress and the workers heard, as
``/health``'s ``fleet`` entry; coordinator/api/preparing_page.py serves it, with the chat page, on the
coordinator's port meanwhile.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Preparation:
    """What the coordinator does now while it prepares a planned fleet: ``step`` starts a phase
    (``progress``), ``progress`` may be refined within it (bytes shipped); ``status()`` is ``/health``'s
    ``fleet`` entry in the shape of coordinator/fleet/replan.py ``Replanner.status``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.progress = "starting"
        self.layers = ""
        self.workers: list[str] = []
        self.candidates: list[dict] = []  # while collecting: every worker address asked, counted or why not
        self._t0 = time.monotonic()

    def heard(self, found: dict, why: list[str]) -> None:
        """A round of Info calls while collecting (planned.collect_capacities' ``on_round``): ``found``
        (worker id -> (address, capacity)) are counted, each line of ``why`` (``ADDRESS: reason``) names one that
        is not (unreachable, refusing this coordinator's --secret, a static worker, another fleet's)."""
        self.workers = sorted(address for address, _ in found.values())
        counted = [{"address": a, "worker_id": w, "counted": True, "why": None}
                   for w, (a, _) in sorted(found.items(), key=lambda item: item[1][0])]
        refused = [{"address": line.split(": ", 1)[0], "worker_id": None, "counted": False,
                    "why": line.split(": ", 1)[-1]} for line in why]
        self.candidates = counted + refused

    def step(self, progress: str) -> None:
        """A new phase (collecting, planning, building, shipping stage i, loading), logged."""
        log.info("preparing the fleet: %s", progress)
        self.progress = progress

    def status(self) -> dict:
        """``/health``'s ``fleet`` entry: state ``preparing``, the progress, seconds since the start."""
        return {"state": "preparing", "progress": self.progress, "reason": f"serve --model {self.source}",
                "phase_s": round(time.monotonic() - self._t0, 1), "layers": self.layers,
                "workers": list(self.workers), "candidates": [dict(c) for c in self.candidates], "replans": 0,
                "last_replan_s": None}
