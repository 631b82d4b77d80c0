"""Launch helpers of rl2gem.parallel.fsdp: ranks per node, a rank without a CUDA device, a rank
whose launcher is gone."""

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from rl2gem.parallel.fsdp import (
    AUTO_RANKS_PER_NODE,
    init_distributed,
    local_device_index,
    local_rank,
    ranks_per_node,
    stop_with_the_launcher,
)


def test_ranks_per_node_is_two_or_one_per_cuda_device_below(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ranks_per_node("auto") == AUTO_RANKS_PER_NODE == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for devices, ranks in ((1, 1), (2, 2), (8, 2)):  # a one-GPU machine: one rank; more: the recipes' two
        monkeypatch.setattr(torch.cuda, "device_count", lambda devices=devices: devices)
        assert ranks_per_node("auto") == ranks
    assert ranks_per_node(3) == ranks_per_node("3") == 3
    for bad in (0, "0", -1, "two", 1.5, True, None):
        with pytest.raises(ValueError, match="auto or an integer >= 1"):
            ranks_per_node(bad)


@pytest.mark.skipif(dist.is_initialized(), reason="a process group of this process exists")
def test_a_rank_past_the_cuda_devices_is_a_clear_error(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU machine: rank 1 names the devices it lacks instead of
    CUDA's "invalid device ordinal"."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device reached"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    environment = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in environment.items():  # set here, so the test leaves the process's environment as it was
        monkeypatch.setenv(name, value)
    with pytest.raises(
        RuntimeError, match=r"LOCAL_RANK=1, but this machine has 1 CUDA device\(s\).*--nproc_per_node=1"
    ):
        init_distributed("cpu:gloo,cuda:nccl")
    assert not dist.is_initialized()


def test_one_gpu_per_process_takes_its_own_device(monkeypatch):
    """SLURM ``--gpus-per-task=1``: each process sees one GPU (``CUDA_VISIBLE_DEVICES`` names one)
    while ``LOCAL_RANK`` counts the node's processes: every rank uses its device 0. With all GPUs
    visible a rank takes its LOCAL_RANK; past them it is the error above."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert [local_device_index(rank, 8) for rank in (0, 3, 7)] == [0, 3, 7]
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2, but this machine has 1 CUDA device"):
        local_device_index(2, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert local_device_index(2, 1) == 0 and local_device_index(0, 1) == 0
    # under torchrun the same single visible GPU is every rank's: two ranks there are the error
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2, but this machine has 1 CUDA device"):
        local_device_index(2, 1)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # two visible: not one GPU per process
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2, but this machine has 2 CUDA device"):
        local_device_index(2, 2)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP's shards), a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.skipif(dist.is_initialized(), reason="a process group of this process exists")
@pytest.mark.parametrize("head", ["value", "reward"])
def test_a_bf16_critic_computes_its_values_in_float32(tiny_dir, monkeypatch, head):
    """A critic (and a reward model) loaded in bf16 computes its scalar head in float32 from the
    bf16 hidden states: plain at one rank (pure bf16 weights), FSDP-wrapped with pure bf16 weights
    (the float32 head a unit of its own: FSDP2 holds one dtype per unit) and with float32 masters
    (mixed precision). Its outputs are float32 and
    equal a float32 matmul of the head's input; gradients reach the head."""
    from rl2gem.parallel.fsdp import load_sharded
    from rl2gem.parallel.mesh import build_mesh
    from rl2gem.procs import free_port

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = build_mesh()
        # pure bf16 plain and FSDP-wrapped (offload: one rank sharded), and float32 masters
        for master, offload in ((None, False), (None, True), (torch.float32, False)):
            model = load_sharded(
                str(tiny_dir), mesh.data_mesh, device=torch.device("cpu"), dtype=torch.bfloat16,
                master_dtype=master, head=head, attention="sdpa", cpu_offload=offload,
            )  # fmt: skip
            with torch.no_grad():  # a head away from its zero start
                for parameter in model.score.parameters():  # one rank: the local shard is the whole
                    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                    local.add_(0.1 * torch.randn(local.shape, generator=torch.Generator().manual_seed(3)))
            seen = []
            model.score.register_forward_hook(lambda module, args, out, seen=seen: seen.append((args[0], out)))
            output = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
            hidden, out = seen[-1]
            weight, bias = (_whole(p) for p in (model.score.weight, model.score.bias))
            assert output.dtype == out.dtype == hidden.dtype == torch.float32, master
            assert weight.dtype == torch.float32
            torch.testing.assert_close(out, torch.nn.functional.linear(hidden, weight, bias))
            # the head's input is the bf16 backbone's output, cast
            assert torch.equal(hidden, hidden.to(torch.bfloat16).float())
            output.sum().backward()
            grad = model.score.weight.grad
            assert grad is not None and float(_whole(grad).abs().sum()) > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(dist.is_initialized(), reason="a process group of this process exists")
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_of_dtensors_and_tensors_equals_torchs(monkeypatch, max_norm):
    """Gradients as DTensors (one rank's shards) beside plain tensors: the norm returned and the
    gradients after clipping equal ``torch.nn.utils.clip_grad_norm_`` on plain copies, clipped
    (0.5) and left as they were (1e3)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from rl2gem.parallel.fsdp import clip_grad_norm
    from rl2gem.parallel.mesh import build_mesh
    from rl2gem.procs import free_port

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = build_mesh().data_mesh
        generator = torch.Generator().manual_seed(7)
        shapes = [(6, 4), (5,), (3, 3), (8,)]
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        ours = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        reference = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        for i, (mine, theirs, grad) in enumerate(zip(ours, reference, grads, strict=True)):
            mine.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]) if i % 2 == 0 else grad.clone()
            theirs.grad = grad.clone()
        expected = float(torch.nn.utils.clip_grad_norm_(reference, max_norm))
        assert clip_grad_norm(ours, max_norm) == pytest.approx(expected, rel=1e-6)
        for mine, theirs in zip(ours, reference, strict=True):
            torch.testing.assert_close(_whole(mine.grad), theirs.grad)
        assert (expected > max_norm) == (max_norm == 0.5)
    finally:
        dist.destroy_process_group()


def test_the_root_unit_is_taken_where_its_copy_and_gradients_are_a_small_share_of_the_gpu(monkeypatch):
    """One rank under mixed precision wraps the root alone when the whole bf16 copy and bf16
    gradients (4 bytes per parameter) are at most 5% of the GPU's memory; always off CUDA."""
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    from rl2gem.parallel.fsdp import ROOT_UNIT_MEMORY_SHARE, root_unit_fits

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    extra = 4 * sum(p.numel() for p in model.parameters())
    cuda = torch.device("cuda", 0)
    assert root_unit_fits(model, torch.bfloat16, torch.device("cpu"))
    for memory, fits in ((extra / ROOT_UNIT_MEMORY_SHARE, True), (extra / ROOT_UNIT_MEMORY_SHARE - 64, False)):
        properties = types.SimpleNamespace(total_memory=int(memory))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=properties: p)
        assert root_unit_fits(model, torch.bfloat16, cuda) is fits
        assert root_unit_fits(model, torch.float16, cuda) is fits
    assert not root_unit_fits(model, torch.float32, cuda)  # twice the bytes


def test_the_rank_on_the_node_comes_from_the_launcher(monkeypatch):
    """torchrun's LOCAL_RANK first, then srun's, Open MPI's and MPICH's; a multi-rank CUDA group
    with none of them is an error naming LOCAL_RANK (every rank would take GPU 0), a CPU one or a
    one-process group takes 0."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 but no rank on the node: set LOCAL_RANK"):
        local_rank(required=True)
    assert local_rank() == 0
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert local_rank(required=True) == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert local_rank(required=True) == 2
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank(required=True) == 3
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert local_rank(required=True) == 0
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("SLURM_LOCALID")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    monkeypatch.delenv("MPI_LOCALRANKID")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert local_rank(required=True) == 0


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_stops_when_its_launcher_is_killed(tmp_path, monkeypatch):
    """torchrun starts each rank in a session of its own: ``kill -9`` of torchrun left the ranks
    training (and writing the run folder beside a resumed run). Here a launcher starts a rank as
    torchrun does; once the launcher is killed, the rank ends within seconds and says why."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert stop_with_the_launcher() is None  # not under torchrun: nothing watches
    out, err = tmp_path / "rank.out", tmp_path / "rank.err"
    service = "import time; print('READY http://127.0.0.1:1', flush=True); time.sleep(120)"
    rank = (
        "import sys, time; from rl2gem.parallel.fsdp import stop_with_the_launcher; "
        "from rl2gem.procs import ServiceProcess; "
        f"server = ServiceProcess([sys.executable, '-c', {service!r}], ready_prefix='READY'); "
        "assert stop_with_the_launcher(0.1) is not None; print('watching', server.proc.pid, flush=True); "
        "time.sleep(120)"
    )
    launcher = (
        "import subprocess, sys, time; "
        f"rank = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True, "
        f"stdout=open({str(out)!r}, 'w'), stderr=open({str(err)!r}, 'w')); "
        "print(rank.pid, flush=True); time.sleep(120)"
    )
    environment = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "RANK": "1"}
    process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=environment)
    pid = int(process.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while "watching" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(pid), err.read_text()
        server = int(out.read_text().split()[1])  # a service the rank started (an engine server)
        assert _running(server)
        process.kill()
        process.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pid)
        deadline = time.monotonic() + 5
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server)  # in a session of its own: the rank's exit alone left it running
        assert f"rank 1: its launcher (pid {process.pid}) is gone" in err.read_text()
    finally:
        if _running(pid):
            os.kill(pid, 9)
