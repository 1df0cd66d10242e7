"""Weight compression options (compiler/compress.py) and their CLI errors; no model is loaded."""

import pytest

from compiler.cli import main
from compiler.compress import (SELF_DRAFT_SPECS, WeightSpec, default_spec, describe, parse_stage_weights,
                               resolve)


def test_defaults_per_size_class():
    small, mid, large = (default_spec("int4", n) for n in (135_000_000, 8_000_000_000, 70_000_000_000))
    assert (small.symmetric, small.group_size, small.ratio) == (False, 32, 0.8)
    assert (mid.symmetric, mid.group_size, mid.ratio) == (True, 128, 0.8)
    assert (large.symmetric, large.group_size, large.ratio) == (True, 128, 1.0)
    assert default_spec("int8", 70_000_000_000) == WeightSpec("int8", symmetric=False)
    assert default_spec("fp16", 1).parameters() == {}


def test_overrides_apply_where_they_mean_something():
    spec = resolve("int4", 135_000_000, symmetric=True, group_size=64, ratio=0.8)
    assert spec == WeightSpec("int4", True, 64, 0.8)
    assert spec.parameters()["mode"] == "int4_sym" and spec.parameters()["backup_mode"] == "int8_asym"
    assert resolve("int8", 135_000_000, symmetric=True, group_size=64, ratio=0.5) == WeightSpec("int8", True)
    assert resolve("fp16", 135_000_000, symmetric=True) == WeightSpec("fp16")
    assert describe("int4", spec.parameters()) == "int4 sym g64 r0.8"
    assert describe("int8", WeightSpec("int8").parameters()) == "int8 asym"
    assert describe("fp16", {}) == "fp16"
    assert SELF_DRAFT_SPECS["int4"] == WeightSpec("int4", True, 64, 1.0)  # the recipe the draft was measured with


def test_stage_weights_parsing():
    assert parse_stage_weights("0=int8, 1=int4", 2) == {0: "int8", 1: "int4"}
    assert parse_stage_weights("", 3) == {}
    for text, message in [("2=int8", "names stage 2, but this build has stages 0..1"), ("0=int8,0=int4", "twice"),
                          ("0:int8", "not STAGE=FORMAT"), ("x=int8", "not STAGE=FORMAT"),
                          ("1=int3", "unknown weight format 'int3'; choose one of fp16, int8, int4")]:
        with pytest.raises(ValueError, match=message):
            parse_stage_weights(text, 2)


@pytest.mark.parametrize("kwargs, message", [({"format": "int2"}, "unknown weight format"),
                                             ({"format": "int4", "group_size": 0}, "group size"),
                                             ({"format": "int4", "ratio": 0.0}, "ratio")])
def test_invalid_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightSpec(**kwargs)


@pytest.mark.parametrize("args, message", [
    (["--weights", "int3"], "argument --weights: invalid choice: 'int3' (choose from 'fp16', 'int8', 'int4')"),
    (["--draft-weights", "q4"], "argument --draft-weights: invalid choice: 'q4'"),
    (["--stage-weights", "0=int5"], "--stage-weights '0=int5': unknown weight format 'int5'"),
    (["--stage-weights", "0int8"], "not STAGE=FORMAT"),
    (["--weights", "int4", "--ratio", "1.5"], "ratio must be in (0, 1], got 1.5"),
    (["--weights", "int4", "--group-size", "0"], "group size must be -1"),
    (["--weights", "int8", "--group-size", "64"], "--group-size and --ratio apply to int4 weights only"),
    (["--symmetric"], "--symmetric/--asymmetric apply to int8 and int4 weights only"),
    (["--weights", "int4", "--symmetric", "--asymmetric"], "not allowed with argument"),
])
def test_bad_weights_options_are_refused_before_loading_the_model(args, message, tmp_path, capsys):
    """Exit code 2 and one line naming the problem; nothing is loaded or written."""
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["build", str(tmp_path / "no-such-model"), "-o", str(tmp_path / "out"), *args]))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
