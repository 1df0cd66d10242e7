import numpy as np
import pytest

from fleet_common import fleet_pb2 as pb
from fleet_common.wire import WireError, address_problem, from_tensor, to_tensor


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "float16"])
def test_round_trip(dtype):
    x = (np.arange(24).reshape(2, 3, 4) * 1.5).astype(dtype)
    msg = pb.Tensor.FromString(to_tensor(x).SerializeToString())
    y = from_tensor(msg)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(x, y)


def test_empty_and_noncontiguous():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(from_tensor(to_tensor(x)), x)
    assert from_tensor(to_tensor(np.zeros((1, 0), np.int64))).shape == (1, 0)


def test_rejects_bad_tensors():
    with pytest.raises(WireError, match="needs 24 bytes"):
        from_tensor(pb.Tensor(data=b"\0" * 23, shape=[2, 3], dtype="float32"))
    with pytest.raises(WireError, match="unknown tensor dtype"):
        from_tensor(pb.Tensor(data=b"", shape=[0], dtype="object"))
    with pytest.raises(WireError, match="negative"):
        from_tensor(pb.Tensor(data=b"", shape=[-1, 0], dtype="int64"))
    with pytest.raises(WireError, match="expected int64"):
        from_tensor(to_tensor(np.zeros(2, np.float32)), dtype="int64")
    with pytest.raises(WireError, match="expected 3 dimensions"):
        from_tensor(to_tensor(np.zeros(2, np.float32)), ndim=3)
    with pytest.raises(WireError, match="cannot travel"):
        to_tensor(np.zeros(2, np.float64))


def test_rejects_shapes_that_overflow():
    """Found by tests/integration/test_fuzz.py: 2**64 elements wrapped to 0 in int64 and passed the
    byte count; a huge dimension beside a 0 made numpy raise a plain ValueError."""
    with pytest.raises(WireError, match="larger than a message can hold"):
        from_tensor(pb.Tensor(data=b"", shape=[2**32, 2**32], dtype="float32"))
    with pytest.raises(WireError, match="larger than a message can hold"):
        from_tensor(pb.Tensor(data=b"", shape=[0, 2**62, 2**62], dtype="int64"))
    with pytest.raises(WireError, match="needs"):
        from_tensor(pb.Tensor(data=b"", shape=[2**20, 2**20], dtype="int64"))


@pytest.mark.parametrize("address, ok", [
    ("127.0.0.1:50051", True), ("[::1]:5", True), ("worker-3.lan:80", True), ("my_host:1", True),
    ("", False), ("127.0.0.1", False), ("127.0.0.1:0", False), ("127.0.0.1:65536", False), ("dns:///x:1", False),
    ("unix:/tmp/s", False), ("host:8O", False), ("h st:1", False), ("١٢:3", False), ("a" * 300 + ":1", False),
])
def test_address_problem(address, ok):
    problem = address_problem(address)
    assert (problem is None) == ok
    assert problem is None or (len(problem) < 120 and "is not host:port" in problem)
