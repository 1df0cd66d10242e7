"""One synchronous OpenVINO inference with as little Python around it as possible.

``InferRequest.infer(dict)`` goes through OpenVINO's Python data dispatcher (a singledispatch per input,
a copy into the request's tensors) and wraps copies of every output in an ``OVDict``: about 80 us of
CPU a call here, on every token of every stage (issue 17, bench/pipeline/hop_overhead.py). ``infer_first``
hands the inputs over as tensors sharing numpy's memory and copies only the first output.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

_infer = ov._pyopenvino.InferRequest.infer  # the binding itself: (request, {name: Tensor}, share_outputs, decode)


def as_tensor(array: np.ndarray) -> ov.Tensor:
    """``array`` as an OpenVINO tensor: sharing its memory when it is C-contiguous and writable (it must
    then stay unchanged until the inference returns), else a copy."""
    if array.flags.c_contiguous and array.flags.writeable:
        return ov.Tensor(array, shared_memory=True)
    return ov.Tensor(np.ascontiguousarray(array))


def infer_first(request: ov.InferRequest, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run ``request`` on ``inputs`` (by input name) and return a copy of its first output. Raises
    ``RuntimeError`` (OpenVINO's) when inference fails, ``TypeError``/``ValueError`` for inputs it cannot take."""
    _infer(request, {name: as_tensor(value) for name, value in inputs.items()}, True, True)
    return request.get_output_tensor(0).data.copy()
