"""An empty worker's pieces (issue 30): its settings (neither --shard nor --model, or both), its announcement
(the capacity in its TXT record, refused by name as a stage), and its speed figure, measured once and cached."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleet_common import PROTOCOL_VERSION
from fleet_common.discovery import Capacity, EmptyWorker, WorkerAd, decode_txt, encode_txt
from worker.capacity import measured_speed, ms_per_layer
from worker.settings import WorkerSettings


def test_shard_and_model_go_together(tmp_path):
    assert WorkerSettings().shard is None and WorkerSettings().model is None  # empty
    assert WorkerSettings(shard=1, model=tmp_path).shard == 1  # static, unchanged
    for half in ({"shard": 0}, {"model": tmp_path}):
        with pytest.raises(ValidationError, match="--shard and --model go together"):
            WorkerSettings(**half)


def test_an_empty_ad_carries_its_capacity_and_is_not_taken_for_a_stage():
    capacity = Capacity(8 << 30, "CPU", 312.5)
    ad = WorkerAd(-1, 0, 0, 0, "", PROTOCOL_VERSION, "", "abc123", 5000, capacity=capacity)
    txt = encode_txt(ad)
    assert txt["state"] == "empty" and txt["mem"] == str(8 << 30) and float(txt["msgb"]) == 312.5
    with pytest.raises(EmptyWorker, match="is empty") as empty:
        decode_txt({k.encode(): v.encode() for k, v in txt.items()}, "10.0.0.2", 5000)
    assert empty.value.capacity == capacity and empty.value.worker_id == "abc123"
    served = WorkerAd(1, 2, 19, 30, "f" * 64, PROTOCOL_VERSION, "m", "id", 5001)
    assert decode_txt({k.encode(): v.encode() for k, v in encode_txt(served).items()}, "h", 5001).stage == 1


def test_the_speed_figure_is_measured_once_and_cached(tmp_path):
    first = measured_speed(tmp_path, "CPU", 1)
    assert not first.cached and 0 < first.ms_per_gb < 10_000 and first.memory_available_bytes > 0
    again = measured_speed(tmp_path, "CPU", 1)
    assert again.cached and again.ms_per_gb == first.ms_per_gb
    (tmp_path / "speed.json").write_text("{not json")
    assert not measured_speed(tmp_path, "CPU", 1).cached  # an unreadable cache is measured over
    assert ms_per_layer(200.0, 5_000_000) == pytest.approx(1.0)  # 5 MB of weights at 200 ms/GB


@pytest.mark.parametrize("content", ["[]", '"x"', "null", "{KEY: {}}", '{KEY: {"ms_per_gb": NaN}}',
                                     '{KEY: {"ms_per_gb": -5}}', '{KEY: {"ms_per_gb": 1e-300}}', '{KEY: 7}'])
def test_a_corrupt_or_implausible_speed_cache_is_measured_over(tmp_path, content):
    """speed.json of the wrong shape crashed the worker at its start ([] and "x"); NaN, -5 or 1e-300 ms per GB
    were announced as they were."""
    import json

    from worker.capacity import SPEED_FILE, speed_key

    (tmp_path / SPEED_FILE).write_text(content.replace("KEY", json.dumps(speed_key("CPU", 1))))
    capacity = measured_speed(tmp_path, "CPU", 1)
    assert not capacity.cached and 0.01 < capacity.ms_per_gb < 10_000
    again = measured_speed(tmp_path, "CPU", 1)  # the figure measured over replaced the bad one
    assert again.cached and again.ms_per_gb == capacity.ms_per_gb
