"""actor.max_length_per_device=auto and out-of-memory back-off (rl2gem.training.autosize)."""

import types

import pytest
import torch
from tiny import tiny_model

from rl2gem.parallel.packing import MicroBatch, regroup_scores
from rl2gem.training import autosize
from rl2gem.training.autosize import (
    CPU_AUTO_LENGTH,
    MULTIPLE,
    PROBE_LENGTHS,
    MaxLength,
    auto_max_length,
    fit_max_length,
)
from rl2gem.training.forward import token_logprobs
from rl2gem.training.metrics import SavedTensorBytes


def test_fit_solves_the_quadratic_for_the_budget():
    def peak(length):
        return 1000 + 2 * length + 0.01 * length**2

    lengths = [256, 512, 1024]
    assert fit_max_length(lengths, [peak(n) for n in lengths], peak(3000)) == 2944  # 3000 rounded down to 64
    assert fit_max_length(lengths, [peak(n) for n in lengths], peak(3000) - 1) == 2944
    assert fit_max_length(lengths, [peak(n) for n in lengths], peak(2944) - 1) == 2880
    linear = [100 + 4 * n for n in lengths]
    assert fit_max_length(lengths, linear, 100 + 4 * 5000) == 4992
    assert fit_max_length(lengths, [peak(n) for n in lengths], 999) == 0  # not even the constant fits
    with pytest.raises(ValueError, match="three probe points"):
        fit_max_length([1, 2], [1, 2], 10)


def test_saved_tensor_bytes_counts_each_storage_once_and_enforces_a_limit():
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorBytes() as saved:
        y = x.exp()  # saves its result (4000 bytes)
        z = x.sin()  # saves x (4000 bytes)
        w = x.cos()  # saves x again: the same storage, not counted twice
    assert saved.bytes == 8000
    (y + z + w).sum().backward()  # the hooks kept the tensors usable
    assert torch.allclose(x.grad, x.exp() + x.cos() - x.sin())
    with pytest.raises(torch.OutOfMemoryError, match="simulated device memory"), SavedTensorBytes(limit=6000):
        x.exp()
        x.sin()
    assert SavedTensorBytes.active == 0


def test_regroup_keeps_every_sequences_values_and_zero_fills_placeholders():
    lengths = [3, 2, 4, 1]
    per_sequence = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(lengths)]
    old = [MicroBatch([0, 1]), MicroBatch([2, 3])]
    scores = [{"old": torch.cat([per_sequence[i] for i in mb.indices])} for mb in old]
    new = [MicroBatch([2]), MicroBatch([0]), MicroBatch([1, 3])]
    out = regroup_scores(scores, old, new, lengths)
    for mb, packed in zip(new, out, strict=True):
        assert torch.equal(packed["old"], torch.cat([per_sequence[i] for i in mb.indices]))
    assert regroup_scores(scores, old, [MicroBatch([0, 1]), MicroBatch([2, 3])], lengths) == scores
    [filled] = regroup_scores(scores[:1], old[:1], [MicroBatch([3], placeholder=True)], lengths)
    assert torch.equal(filled["old"], torch.zeros(1))  # sequence 3 was never on this rank
    # a placeholder pass over a sequence this rank also holds for real: the real pass's values stay
    held = [MicroBatch([0]), MicroBatch([0], placeholder=True)]
    scores = [{"old": per_sequence[0]}, {"old": torch.full((3,), 777.0)}]
    [kept] = regroup_scores(scores, held, [MicroBatch([0])], lengths)
    assert torch.equal(kept["old"], per_sequence[0])


def activation_bytes(model, length):
    ids = [torch.randint(model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()]
    with SavedTensorBytes() as saved:
        token_logprobs(model, ids, torch.device("cpu"), entropy="grad")
    return saved.bytes


def test_auto_picks_the_longest_length_that_fits_a_simulated_device(monkeypatch):
    real_probe, measured = autosize._probe, {}

    def probe(worker, tokens, device):  # on the CPU a probe's bytes are exact: each length measured once
        if tokens not in measured:
            measured[tokens] = real_probe(worker, tokens, device)
        return measured[tokens]

    monkeypatch.setattr(autosize, "_probe", probe)
    model = tiny_model()
    worker = types.SimpleNamespace(model=model, head="lm", optimizer=torch.optim.AdamW(model.parameters()))
    limit = activation_bytes(model, 1500)
    monkeypatch.setenv("RL2GEM_SIMULATED_MEMORY_MIB", str(limit / 2**20))
    chosen = auto_max_length([worker], torch.device("cpu"), fraction=0.8)
    assert chosen % MULTIPLE == 0 and chosen > max(PROBE_LENGTHS)  # extrapolated past the probes
    assert activation_bytes(model, chosen) <= limit < activation_bytes(model, chosen + MULTIPLE)
    monkeypatch.setenv("RL2GEM_SIMULATED_MEMORY_MIB", str(1 << 30))  # memory is no limit: 32-bit indexing is
    vocabulary = model.config.vocab_size  # 49152: 2**31 elements of logits at 43,690 tokens
    assert auto_max_length([worker], torch.device("cpu"), fraction=0.8) == 2**31 // vocabulary // 64 * 64 == 43648
    monkeypatch.setenv("RL2GEM_SIMULATED_MEMORY_MIB", str(limit / 2**20))
    reserved = limit - activation_bytes(model, 800)  # an engine's KV store kept through the update
    smaller = auto_max_length([worker], torch.device("cpu"), fraction=0.8, reserved_bytes=reserved)
    assert activation_bytes(model, smaller) <= limit - reserved < activation_bytes(model, smaller + MULTIPLE)
    assert all(p.grad is None for p in model.parameters())  # the probes leave no gradients behind
    monkeypatch.setenv("RL2GEM_SIMULATED_MEMORY_MIB", str(activation_bytes(model, 64) / 2**20 / 2))
    with pytest.raises(RuntimeError, match="not even 64 tokens"):
        auto_max_length([worker], torch.device("cpu"), fraction=0.8)


class _Worker:
    """What :class:`MaxLength` reads of a worker: its model, optimizer and count of optimizer steps."""

    def __init__(self):
        self.model = torch.nn.Module()  # no FSDP: nothing to reset after a failed backward
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.weight.grad = torch.ones(2)
        self.optimizer = torch.optim.SGD([self.weight], lr=0.1)
        self.optimizer_steps = 0


def _max_length(tmp_path, value, backoff=True):
    mesh = types.SimpleNamespace(micro_batch_tokens=lambda tokens: tokens)  # sp = tp = 1
    section = {"max_length_per_device": value, "oom_backoff": backoff}
    return MaxLength(section, [_Worker()], mesh, torch.device("cpu"), tmp_path)


def test_auto_probes_a_device_and_off_cuda_is_the_cpu_length(tmp_path, monkeypatch):
    """``auto`` (the default) off CUDA is :data:`CPU_AUTO_LENGTH` without probing (``_Worker``'s model
    is an empty module: a probe would fail); a simulated device is probed, as CUDA is."""
    monkeypatch.delenv("RL2GEM_SIMULATED_MEMORY_MIB", raising=False)
    assert _max_length(tmp_path, "auto").value == CPU_AUTO_LENGTH == 2048
    mesh = types.SimpleNamespace(micro_batch_tokens=lambda tokens: tokens)
    offline = MaxLength(
        {"max_length_per_device": "auto"}, [_Worker()], mesh, torch.device("cpu"), tmp_path, cpu_length=4096
    )
    assert offline.value == 4096
    # a recipe sized for the CPU (cpu_max_length_per_device) leaves CUDA, and a simulated device, to the probe
    section = {"max_length_per_device": "auto", "cpu_max_length_per_device": 1024}
    assert MaxLength(section, [_Worker()], mesh, torch.device("cpu"), tmp_path, cpu_length=4096).value == 1024
    monkeypatch.setenv("RL2GEM_SIMULATED_MEMORY_MIB", "1")
    with pytest.raises(AttributeError, match="config"):  # probed: the fake worker's model cannot be
        MaxLength(section, [_Worker()], mesh, torch.device("cpu"), tmp_path)
    with pytest.raises(AttributeError, match="config"):
        _max_length(tmp_path, "auto")
    with pytest.raises(ValueError, match="positive integer or auto"):
        _max_length(tmp_path, 0)


def test_out_of_memory_halves_the_length_until_the_passes_fit(tmp_path):
    """The passes fit at 256 tokens or fewer: from 1024 the step runs at 1024, 512, then 256, and
    each retry starts with no gradients left from the failed one (trainers/ppo.py runs the same
    end to end: tests/trainers/test_ppo.py)."""
    length, tried = _max_length(tmp_path, 1024), []

    def passes():
        tried.append(length.micro_batch_tokens)
        assert all(p.grad is None for w in length.workers for p in [w.weight]) or len(tried) == 1
        if length.micro_batch_tokens > 256:
            raise torch.OutOfMemoryError("simulated")
        return "done"

    with pytest.warns(UserWarning, match="retrying the step at") as warned:
        assert length.run(passes, longest=100) == "done"
    assert tried == [1024, 512, 256] and length.value == 256
    assert [str(w.message).rsplit(" ", 1)[1] for w in warned] == ["512", "256"]
    assert not (tmp_path / "max_length_per_device").exists()  # one rank: retried in place, nothing recorded


def test_out_of_memory_halves_from_the_largest_planned_micro_batch(tmp_path):
    """A plan that held at most 300 tokens under a 4096-token budget ran out of memory: the retry
    runs at 150 (half what was planned), not at 2048 (which would plan the same micro-batches)."""
    length, tried = _max_length(tmp_path, 4096), []

    def passes():
        tried.append(length.micro_batch_tokens)
        if len(tried) == 1:
            raise torch.OutOfMemoryError("simulated")
        return "done"

    with pytest.warns(UserWarning, match="retrying the step at 150"):
        assert length.run(passes, longest=100, planned=lambda: 300) == "done"
    assert tried == [4096, 150] and length.value == 150


def test_out_of_memory_said_by_a_runtime_error_is_retried_and_other_errors_are_not(tmp_path):
    """cuBLAS, cuDNN and extension kernels report running out of memory as ``RuntimeError``s."""
    length, tried = _max_length(tmp_path, 1024), []

    def passes():
        tried.append(length.micro_batch_tokens)
        if len(tried) == 1:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        if len(tried) == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "done"

    with pytest.warns(UserWarning, match="retrying the step"):
        assert length.run(passes, longest=100) == "done"
    assert tried == [1024, 512, 256]

    def shape_error():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        length.run(shape_error, longest=100)
    assert length.value == 256


def test_out_of_memory_is_raised_when_it_cannot_be_retried(tmp_path):
    def out_of_memory():
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError, match="simulated"):  # actor.oom_backoff=false: as raised
        _max_length(tmp_path, 1024, backoff=False).run(out_of_memory, longest=100)
    # a micro-batch at 128 tokens holds one 128-token sequence already
    with pytest.raises(torch.OutOfMemoryError, match="nothing left to halve") as raised:
        _max_length(tmp_path, 128).run(out_of_memory, longest=128)
    assert "actor.max_length_per_device=128" in str(raised.value)
    stepped = _max_length(tmp_path, 1024)

    def step_then_out_of_memory():
        stepped.workers[0].optimizer_steps += 1  # an optimizer step taken: a retry would step twice
        out_of_memory()

    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        stepped.run(step_then_out_of_memory, longest=100)
    assert stepped.value == 1024


def test_state_on_the_host_is_not_taken_off_the_device_budget():
    """``actor.cpu_offload`` keeps the parameter shards, their gradients and AdamW's moments on the
    host: on CUDA they weigh nothing against the device's budget (they were taken off it, so the
    auto length came out shorter than what fits); on the CPU every trainable byte counts."""
    model = torch.nn.Linear(16, 8)  # 8 x 16 + 8 float32 = 544 bytes, on the host
    model.bias.requires_grad_(False)
    worker = types.SimpleNamespace(model=model, optimizer=torch.optim.AdamW([model.weight]))  # no state yet
    assert autosize._trainable_bytes(worker, torch.device("cpu")) == 8 * 16 * 4
    assert autosize._trainable_bytes(worker, torch.device("cuda")) == 0
    assert autosize._unallocated_state_bytes(worker, torch.device("cuda")) == 0
    # on the CPU: the two moments not yet allocated, and the gradients the probe does not see
    assert autosize._unallocated_state_bytes(worker, torch.device("cpu")) == 3 * 8 * 16 * 4
