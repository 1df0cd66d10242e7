"""Several coordinators announced on one LAN: fleet-chat and ``fleet-coordinator status`` without ``--url``
list them (model and address) and pick one only by ``--model``, never silently (issue 20, item 3).

Real coordinators announce themselves with zeroconf on loopback; they need no workers for this."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from coordinator.chat.client import NoCoordinator, choose_api
from tests.conftest import BIN, start_coordinator

pytestmark = pytest.mark.integration


def test_choose_api_never_picks_silently():
    found = [("http://10.0.0.1:8000", "llama-8b"), ("http://10.0.0.2:8000", "qwen-7b")]
    assert choose_api(found[:1], None, "x") == "http://10.0.0.1:8000"
    assert choose_api(found, "qwen-7b", "x") == "http://10.0.0.2:8000"
    with pytest.raises(NoCoordinator, match=r"2 coordinators found \(llama-8b at http://10.0.0.1:8000; qwen-7b at "
                                            r"http://10.0.0.2:8000\); choose one with --model NAME or --url"):
        choose_api(found, None, "x")
    with pytest.raises(NoCoordinator, match="no coordinator serves model 'mistral'; found: llama-8b at"):
        choose_api(found, "mistral", "x")
    with pytest.raises(NoCoordinator, match="no coordinator found with zeroconf; pass --url"):
        choose_api([], None, "x")


def _renamed(build, folder, model_id):  # noqa: ANN001
    """A copy of ``build`` (hard links) whose manifest names another model."""
    shutil.copytree(build, folder, copy_function=os.link)
    manifest = json.loads((build / "manifest.json").read_text())
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(json.dumps({**manifest, "model_id": model_id}))
    return folder


def test_two_coordinators_are_listed_and_chosen_by_model(build_2, tmp_path):
    other = _renamed(build_2, tmp_path / "other-build", "other-model")
    procs = []
    try:
        for build, name in ((build_2, "a"), (other, "b")):
            log_dir = tmp_path / name
            log_dir.mkdir()
            procs.append(start_coordinator(build, log_dir, "--no-discover", announce=True))
        urls = {name: url for name, (_, url) in zip("ab", procs)}
        run = lambda *a: subprocess.run([str(BIN / a[0]), *a[1:]], capture_output=True, text=True, timeout=60)  # noqa: E731
        listed = run("fleet-chat", "-p", "hi")
        assert listed.returncode == 2, listed.stdout + listed.stderr
        assert "2 coordinators found" in listed.stderr and "--model NAME or --url" in listed.stderr, listed.stderr
        for name in "ab":
            assert urls[name] in listed.stderr, listed.stderr
        assert "other-model at " + urls["b"] in listed.stderr
        chosen = run("fleet-chat", "--model", "other-model", "-p", "hi")
        assert f"connected to {urls['b']}" in chosen.stdout + chosen.stderr, chosen.stdout + chosen.stderr
        status = run("fleet-coordinator", "status")
        assert status.returncode == 1 and "2 coordinators found" in status.stderr, status.stderr
        status = run("fleet-coordinator", "status", "--model", "other-model")
        assert urls["b"] in status.stdout, status.stdout + status.stderr
    finally:
        for proc, _ in procs:
            proc.stop()
