"""The chat page's pure modules (coordinator/api/static: the SSE reader, the conversation store, the request's
sampling, the markdown renderer) under node's own test runner: ``node --test tests/js/*.test.mjs``. node
is a system package (deploy/setup.sh installs it where missing); without it the test skips, or fails in
CI. And the vendored renderer is the file vendor/README.md names."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JS_TESTS = ROOT / "tests" / "js"
VENDOR = ROOT / "coordinator" / "api" / "static" / "vendor"


def node() -> str:
    """The node binary (18 or newer: ``node --test``), or skip (fail in CI) naming what is missing."""
    found = shutil.which("node")
    reason = "node is not installed (deploy/setup.sh installs Debian's nodejs where apt-get is usable)"
    if found:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        major = re.match(r"v(\d+)\.", version)
        if major and int(major.group(1)) >= 18:
            return found
        reason = f"node {version} is older than 18, which has no 'node --test'"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def test_page_modules_pass_their_node_tests():
    files = sorted(JS_TESTS.glob("*.test.mjs"))
    assert len(files) >= 4, files
    # the files named, not the folder: node 22 takes globs where node 18 and 20 take folders
    run = subprocess.run([node(), "--test", *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    passed = re.search(r"^# pass (\d+)$", report, re.M)
    failed = re.search(r"^# fail (\d+)$", report, re.M)
    assert passed and int(passed.group(1)) > 0 and failed and failed.group(1) == "0", report[-3000:]


def test_the_vendored_renderer_is_the_one_its_readme_names():
    readme = (VENDOR / "README.md").read_text()
    for name in ("markdown-it.esm.min.js", "markdown-it.LICENSE"):
        digest = hashlib.sha256((VENDOR / name).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(name)}`.*`{digest}`", readme), (name, digest)
    assert "Permission is hereby granted, free of charge" in (VENDOR / "markdown-it.LICENSE").read_text()  # MIT
