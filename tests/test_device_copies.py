"""rl2gem.devices: host index arrays to the device in one copy."""

import numpy as np
import torch

from rl2gem.devices import indexes_to_device


def test_indexes_to_device_gives_each_array_back_as_int64_in_order():
    """Arrays of several dtypes and lengths (an empty list, booleans, a float array of whole
    numbers, a Python list) come back one tensor each, int64, equal to the inputs, as views of
    one buffer (one copy)."""
    arrays = [np.array([3, 1, 2]), [], np.array([True, False]), np.zeros(0), np.array([4.0, 5.0]), [7, 8, 9, 10]]
    out = indexes_to_device(arrays, torch.device("cpu"))
    assert [t.tolist() for t in out] == [[3, 1, 2], [], [1, 0], [], [4, 5], [7, 8, 9, 10]]
    assert all(t.dtype == torch.int64 for t in out)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
