"""Every tensor the algorithms create lives on their inputs' device.

A CPU-only check of what a GPU run needs: the inputs are CPU tensors while the default device is
``meta``, so a tensor created without ``device=`` (``torch.zeros(n)``, ``torch.arange(n)``) lands
on ``meta`` and the first operation mixing it with an input raises (on CUDA the same code mixes a
CPU tensor with CUDA ones). Each result must equal the same call made normally. The CUDA run of
these calls is ``tests/test_gpu.py::test_algorithms_run_on_the_inputs_device``.
"""

import pytest
import torch
from algorithm_calls import batch, calls, tensors_of

CALLS = [name for name, _ in calls(batch())]


@pytest.mark.parametrize("name", CALLS)
def test_algorithms_create_tensors_on_the_inputs_device(name):
    expected = tensors_of(dict(calls(batch()))[name]())
    assert expected, name
    thunk = dict(calls(batch()))[name]  # the inputs made before the default device changes
    with torch.device("meta"):
        got = tensors_of(thunk())
    assert len(got) == len(expected)
    for have, want in zip(got, expected, strict=True):
        assert have.device.type == "cpu"
        torch.testing.assert_close(have, want)
