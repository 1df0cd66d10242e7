"""``fleet-coordinator``'s entry point: the coordinator's CLI (``coordinator.cli``) without OpenVINO's converter.

``import openvino`` also imports OpenVINO's model converter (``openvino.tools.ovc``, with its telemetry client,
urllib, http, email and numpy.ma) unless it is absent: about 0.1 s of CPU at every start on the 2-core Zen 3 this
was measured on. Nothing the coordinator runs converts a model with it: fleet's compiler (``serve --model
SOURCE``, drafts) writes its graphs itself and NNCF compresses them without it."""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``fleet-coordinator`` (``coordinator.cli.main``) without OpenVINO's converter; returns its exit code."""
    sys.modules.setdefault("openvino.tools.ovc", None)  # None: `import openvino` finds it absent and goes on
    from coordinator.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
