"""bench/pipeline/interleave_bench.py --llama-cpp without llama.cpp: its options, the layer split it gives
llama-server, and the comparison tables (the runs themselves need bench/build_llama_cpp.sh's build)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pipeline.interleave_bench import parse_args
from bench.pipeline.llama_cpp import binaries, comparison_table, median_cell, memory_rows, tensor_split


def test_options_default_to_1_2_4_users_with_llama_cpp(tmp_path: Path) -> None:
    args = parse_args(["--llama-cpp", "--llama-cpp-bin", str(tmp_path), "--repeats", "5"])
    assert (args.llama_cpp, args.llama_cpp_bin, args.repeats, args.users) == (True, tmp_path, 5, [1, 2, 4])
    assert parse_args([]).users == [1, 2, 4, 8]
    assert parse_args(["--users", "1,3"]).users == [1, 3]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--users", "1,0"], ["--users", "two"], ["--tokens", "-1"]])
def test_bad_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--llama-cpp", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_missing_binaries_name_the_folder_and_the_build_script(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"build_llama_cpp\.sh") as exc:
        binaries(tmp_path)
    assert str(tmp_path) in str(exc.value)


def split_of(weights: list[int], n_layer: int) -> list[int]:
    """Device of each of llama.cpp's n_layer + 1 slots (the output last) for --tensor-split weights, as
    src/llama-model.cpp load_tensors assigns them (upper_bound of slot / (n_layer + 1) in the
    cumulative, normalised split), in float32 as there."""
    import bisect

    import numpy as np

    cum = np.cumsum(np.array(weights, dtype=np.float32)) / np.float32(sum(weights))
    return [bisect.bisect_right(list(cum), np.float32(il) / np.float32(n_layer + 1)) for il in range(n_layer + 1)]


@pytest.mark.parametrize("ranges", [[(0, 19), (19, 30)], [(0, 15), (15, 30)], [(0, 10), (10, 21), (21, 30)]])
def test_tensor_split_puts_each_stage_on_its_rpc_server(ranges: list[tuple[int, int]]) -> None:
    stages = [{"start": a, "end": b} for a, b in ranges]
    devices = split_of(tensor_split(stages), ranges[-1][1])
    want = [i for i, (a, b) in enumerate(ranges) for _ in range(a, b)] + [len(ranges) - 1]  # output: last stage
    assert devices == want


def test_tensor_split_refuses_gaps() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        tensor_split([{"start": 0, "end": 10}, {"start": 12, "end": 30}])


def run(users: int, agg: float, ttft: float, cpu: float, tokens: int = 8) -> dict:
    answers = [{"text": "x", "usage": {"completion_tokens": tokens, "prompt_tokens": 40}}] * users
    return {"users": users, "aggregate_tok_s": agg, "per_user_tok_s": agg / users, "ttft_ms": ttft, "wall_s": 1.0,
            "cpu_ms_per_token": {"worker 0": cpu, "client": 100.0}, "answers": answers}


def test_cells_are_medians_and_the_ratio_is_the_median_of_paired_runs() -> None:
    fleet = [median_cell([run(1, 30, 100, 20), run(1, 10, 300, 10), run(1, 20, 200, 30)], 8),
             median_cell([run(2, 40, 400, 12)], 8)]
    llama = [median_cell([run(1, 60, 100, 10), run(1, 10, 150, 10), run(1, 40, 400, 10)], 8),
             median_cell([run(2, 20, 800, 24)], 8)]
    assert (fleet[0]["aggregate_tok_s"], fleet[0]["ttft_ms"], fleet[0]["cpu_ms_per_token"]) == (20, 200, 20)
    header, _, one, two = comparison_table(fleet, llama)
    assert header.count("fleet / llama.cpp / ÷") == 4
    # TTFT: medians 200 and 150, but the runs taken together are 1.0, 2.0 and 0.5 times: 1.00, not 1.33
    assert one == "| 1 | 20.0 / 40.0 / 0.50 | 20.0 / 40.0 / 0.50 | 200 / 150 / 1.00 | 20.0 / 10.0 / 2.00 |"
    assert two == "| 2 | 40.0 / 20.0 / 2.00 | 20.0 / 10.0 / 2.00 | 400 / 800 / 0.50 | 12.0 / 24.0 / 0.50 |"
    with pytest.raises(ValueError, match="user counts"):
        comparison_table(fleet, llama[:1])
    with pytest.raises(ValueError, match="not paired"):
        comparison_table(fleet[:1], [median_cell([run(1, 60, 100, 10)], 8)])


def test_a_short_answer_is_an_error_not_a_faster_cell() -> None:
    with pytest.raises(RuntimeError, match="7 completion tokens, not 8"):
        median_cell([run(1, 30, 100, 20, tokens=7)], 8)


def test_memory_rows_split_stage_processes_from_the_front() -> None:
    rows = memory_rows({"worker 0": 300, "worker 1": 200, "coordinator": 150},
                       {"rpc-server 0": 100, "rpc-server 1": 100, "llama-server": 150})
    assert rows[2:] == ["| stages (workers / rpc-servers) | 500 | 200 | 2.50 |",
                        "| coordinator / llama-server | 150 | 150 | 1.00 |", "| all | 650 | 350 | 1.86 |"]
