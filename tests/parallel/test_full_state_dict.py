"""rl2gem.parallel.fsdp.full_state_dict at one rank (no process group): the model's values, on the
device asked for, in memory of their own (the GPU twin is tests/test_gpu.py's weight-sync test)."""

import torch
from tiny import tiny_model

from rl2gem.parallel.fsdp import full_state_dict


def test_a_full_state_dict_is_a_copy_that_later_updates_do_not_touch():
    model = tiny_model()
    state = full_state_dict(model, "cpu")
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert state[name].device.type == "cpu" and torch.equal(state[name], tensor)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # an optimizer step
    assert all(not torch.equal(state[n], t) for n, t in model.named_parameters())


def test_a_full_state_dict_in_another_dtype_is_the_cast_of_each_tensor():
    """``dtype``: floating tensors cast (float32 masters sent to a bfloat16 engine), integer
    buffers kept; a copy either way."""
    model = tiny_model().float()
    model.register_buffer("counter", torch.arange(3))
    state = full_state_dict(model, "cpu", torch.bfloat16)
    for name, tensor in model.state_dict().items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert state[name].dtype == expected.dtype and torch.equal(state[name], expected), name
        assert state[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
