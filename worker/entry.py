"""``fleet-worker``'s entry point: the worker's CLI (``worker.cli``) in a process that never converts a model.

``import openvino`` also imports OpenVINO's model converter (``openvino.tools.ovc``, which loads its telemetry
client and urllib, http and email with it) unless it is absent: about 0.1 s of CPU at every worker start
(0.33 -> 0.20 s for ``import openvino`` on the 2-core Zen 3 this was measured on), of 1.3 s in all. A worker
only reads built stages (``fleet-compiler`` converts), so it goes without it. The coordinator keeps it: it runs
the compiler for ``serve --model SOURCE`` and its drafts."""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``fleet-worker`` (``worker.cli.main``) without OpenVINO's converter; returns its exit code."""
    sys.modules.setdefault("openvino.tools.ovc", None)  # None: `import openvino` finds it absent and goes on
    from worker.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
