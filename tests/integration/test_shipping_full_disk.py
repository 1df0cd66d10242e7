"""A worker's disk filling up while its stage arrives (issue 30 item 6), on a real ``fleet-worker`` process
whose stage cache is a real tmpfs of 160 MiB (skipped where one cannot be mounted): the demo's stage 1 (135 MB)
fits when the transfer starts, then the test fills the disk midway. The sender gets one error naming the
worker's address, the file, the bytes free and the bytes still needed; the worker holds no file in place and
loads nothing; once space is freed the transfer resumes at the bytes it holds. Run with --no-announce: other
tests on this machine must not find it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from contextlib import ExitStack

import grpc
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common import fleet_pb2_grpc as pb_grpc
from fleet_common.manifest import load_manifest
from fleet_common.security import Security, open_channel
from fleet_common.shipping import ShippingError, load_stage, ship_stage
from tests.integration.test_shipping import held, serving, spawn_worker

pytestmark = pytest.mark.integration

FILL_AT = 16 << 20  # bytes of the .bin sent when the disk is filled
LEFT = 8 << 20  # bytes left free then (the rest of the .bin is over 100 MB)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 160 MiB at ``tmp_path/disk``, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(mount)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_disk_filled_midway_is_one_error_naming_the_worker_and_resumes_once_freed(build_2, tmp_path, small_disk):
    loaded = load_manifest(build_2)
    entry = loaded.manifest.stages[1]
    filler = small_disk / "filler"

    def fill(path: str, done: int, size: int) -> None:  # the sender's progress: fill the disk once, midway
        if path == entry.bin and done >= FILL_AT and not filler.exists():
            with open(filler, "wb") as f:
                for _ in range(20):  # the worker writes meanwhile: its pieces may take the space measured
                    try:
                        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(small_disk).free - LEFT)
                        return
                    except OSError:
                        continue
            raise AssertionError("could not fill the disk")

    with ExitStack() as stack:
        address = serving(spawn_worker(tmp_path / "worker.log", stack, "--stages-dir", str(small_disk / "stages")),
                          empty=True)

        async def run() -> tuple[ShippingError, dict, pb.InfoReply, ShippingError]:
            async with open_channel(address, Security()) as channel:
                with pytest.raises(ShippingError) as full:
                    await ship_stage(channel, build_2, 1, fill, address=address)
                files = await held(channel, build_2)
                with pytest.raises(ShippingError) as not_loaded:
                    await load_stage(channel, build_2, 1, address=address)
                info = await pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=30)
                filler.unlink()
                report = await ship_stage(channel, build_2, 1, address=address)
                assert entry.bin in report.completed and report.held_bytes >= FILL_AT, report
                assert report.sent_bytes + report.held_bytes == sum(
                    (build_2 / p).stat().st_size for p in (entry.xml, entry.bin)), report
                return full.value, files, info, not_loaded.value

        full, files, info, not_loaded = asyncio.run(run())
    message = str(full)
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
    size = (build_2 / entry.bin).stat().st_size
    if message.startswith(f"worker {address}: PutStage of {entry.bin}"):  # the worker's refusal of the stream
        assert "disk full in the stage cache" in message, message
        assert " bytes free, " in message and " more needed for this file" in message, message
        assert f"of {size:,} bytes" in message, message
    else:  # gRPC lost that refusal under the stream's writes ("Internal error from Core", taken for a cut link):
        # the resumed attempt's StageStatus found the disk full (seen once with two test files at a time)
        assert message.startswith(f"worker {address}: stage 1 needs "), message
        assert f"more bytes in its stage cache ({entry.bin}), which has " in message and " free " in message, message
    bin_bytes, complete = files[entry.bin]
    assert not complete and FILL_AT <= bin_bytes < size, files  # a partial file only, never in place
    assert "not in the cache: missing" in str(not_loaded) and info.empty and not info.manifest_sha256
