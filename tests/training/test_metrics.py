"""Metric helpers: weighted averages (placeholders weigh 0), FLOPs, the measured peak, RolloutConfig from a config."""

import pytest
import torch

from rl2gem.rollout import RolloutConfig
from rl2gem.training import Averager, measure_peak_flops, train_flops


def test_averager_weights_and_placeholders():
    avg = Averager()
    avg.add({"loss": 2.0, "clip": 0.5})
    avg.add({"loss": 4.0, "clip": 0.1}, weight=3.0)
    avg.add({"loss": 100.0, "clip": 9.0}, weight=0.0)  # a placeholder micro-batch
    means = avg.means("actor/")
    assert means["actor/loss"] == pytest.approx((2 + 12) / 4) and means["actor/clip"] == pytest.approx((0.5 + 0.3) / 4)
    empty = Averager()
    empty.add({"x": 5.0}, weight=0.0)
    assert empty.means() == {"x": 0.0}


def test_train_flops_by_hand():
    # 2P per forward-only token (scoring + generated), 6P per trained token
    assert train_flops(10, forward_tokens=3, train_tokens=2, generated_tokens=1) == 2 * 10 * 4 + 6 * 10 * 2


def test_measured_peak_is_a_plausible_flop_rate():
    peak = measure_peak_flops(torch.device("cpu"), size=256, repeats=2)
    assert 1e8 < peak < 1e14


def test_rollout_config_from_a_config_section():
    section = {"max_new_tokens": 7, "temperature": 0.3, "prompts_per_rollout": 8, "is_mode": "truncated"}
    config = RolloutConfig.from_mapping(section, temperature=0.0, seed=5)
    assert (config.max_new_tokens, config.temperature, config.seed) == (7, 0.0, 5)
    assert config.responses_per_prompt == RolloutConfig().responses_per_prompt  # not in the section: the default
    with pytest.raises(TypeError, match="no field"):
        RolloutConfig.from_mapping(section, prompts_per_rollout=3)
    with pytest.raises(ValueError, match=r"\['is_mode'\] are not rollout settings"):  # a trainer's section: strict
        RolloutConfig.from_mapping(section, known=["prompts_per_rollout"])
    assert RolloutConfig.from_mapping(section, known=["prompts_per_rollout", "is_mode"]).max_new_tokens == 7


def test_peak_memory_sees_a_freed_allocation_inside_its_phase():
    import psutil

    from rl2gem.training.metrics import PeakMemory, release_free_heap

    memory = PeakMemory(torch.device("cpu"), interval=0.001)
    # free heap that earlier tests left resident would serve the tensor without the RSS growing
    # (CI once measured a peak 0.004 MiB over the baseline that way)
    release_free_heap()
    baseline = psutil.Process().memory_info().rss / 2**20
    with memory.phase("big"):
        block = torch.ones(64 * 2**20)  # 256 MiB, touched
        block.add_(1)
        del block
    with memory.phase("small"):
        torch.ones(1024).sum()
    peaks = memory.metrics()
    assert set(peaks) == {"memory/big_peak_mib", "memory/small_peak_mib"}
    assert peaks["memory/big_peak_mib"] - baseline > 200  # seen although freed before the phase ended
    assert peaks["memory/small_peak_mib"] < peaks["memory/big_peak_mib"] - 200
    assert memory.metrics() == {}  # each call starts over


def _fragmented_heap(blocks: int = 8192) -> list[torch.Tensor]:
    """512 MiB in 64 KiB tensors (below glibc's mmap threshold: heap memory), every other one freed:
    256 MiB of free heap between live blocks, which glibc cannot give back by shrinking the heap's top."""
    tensors = [torch.ones(16 * 1024) for _ in range(blocks)]
    del tensors[::2]
    return tensors


def test_a_phase_returns_freed_heap_to_the_system():
    import psutil

    from rl2gem.training.metrics import PeakMemory, _glibc_malloc_trim, release_free_heap

    if _glibc_malloc_trim() is None:
        pytest.skip("the C library is not glibc: nothing to release")
    process = psutil.Process()

    def growth(memory: PeakMemory) -> tuple[float, list[torch.Tensor]]:
        before = process.memory_info().rss
        with memory.phase("fragment"):
            kept = _fragmented_heap()
        return (process.memory_info().rss - before) / 2**20, kept

    release_free_heap()  # free heap left by earlier tests is not resident, so reusing it counts as growth
    held, kept = growth(PeakMemory(torch.device("cpu"), release_every=None))
    assert held > 450  # the freed half is still resident: glibc kept it
    del kept
    release_free_heap()
    released, kept = growth(PeakMemory(torch.device("cpu")))
    assert released < 350 and held - released > 150  # ~256 MiB live, the freed ~256 MiB given back
    assert sum(t.numel() for t in kept) == 4096 * 16 * 1024  # the live tensors are untouched
    assert all(bool((t == 1).all()) for t in kept[::512])


@pytest.mark.parametrize(
    "name,dtype,tera,what",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4, "H100/H200 SXM bf16"),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5, "H100 PCIe bf16"),
        ("NVIDIA H100 NVL", torch.float16, 835.5, "H100 NVL bf16"),
        ("NVIDIA H200", torch.bfloat16, 989.4, "H100/H200 SXM bf16"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5, "A100 fp32"),
        ("NVIDIA L40S", torch.bfloat16, 362.05, "L40S bf16"),
        ("NVIDIA L4", torch.bfloat16, 121.0, "L4 bf16"),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4, "MI300X bf16"),
    ],
)
def test_datasheet_peaks_by_device_name(name, dtype, tera, what):
    from rl2gem.training.metrics import datasheet_peak_flops

    peak, source = datasheet_peak_flops(name, dtype)
    assert peak == pytest.approx(tera * 1e12) and source.startswith(what)


def test_tf32_and_unknown_devices():
    from rl2gem.training.metrics import datasheet_peak_flops

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls allowed
    try:
        assert datasheet_peak_flops("NVIDIA A100 80GB PCIe", torch.float32)[0] == pytest.approx(156e12)
    finally:
        torch.set_float32_matmul_precision(before)
    assert datasheet_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # not the A10: not guessed
    assert datasheet_peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None


def test_peak_from_config_prints_its_source(capsys, monkeypatch):
    import rl2gem.training.metrics as metrics

    assert metrics.peak_flops_from_config(123e12, torch.device("cpu"), torch.float32) == 123e12
    assert "MFU peak: 123 TFLOP/s per rank (trainer.peak_flops)" in capsys.readouterr().out
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device, dtype: 2e11)
    assert metrics.peak_flops_from_config(None, torch.device("cpu"), torch.float32) == 2e11
    assert "(measured: a 1024^3 float32 matmul)" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops_from_config(None, torch.device("cuda"), torch.bfloat16) == pytest.approx(989.4e12)
    assert "(H100/H200 SXM bf16 dense, datasheet)" in capsys.readouterr().out


def test_the_kernel_s_peak_is_read_and_reset_per_phase():
    """On Linux the phase's peak is the kernel's ``VmHWM`` reset as it starts: a spike the sampler
    thread never ran during (here it samples once an hour) is still seen."""
    import psutil

    from rl2gem.training.metrics import PeakMemory, peak_rss, release_free_heap, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here")
    memory = PeakMemory(torch.device("cpu"), interval=3600.0, release_every=None)
    release_free_heap()  # the tensor's pages come fresh, not from resident free heap
    baseline = psutil.Process().memory_info().rss / 2**20
    with memory.phase("spike"):
        block = torch.ones(64 * 2**20)
        del block
    assert memory.metrics()["memory/spike_peak_mib"] - baseline > 200
    assert reset_peak_rss() and abs(peak_rss() - psutil.Process().memory_info().rss) < 16 * 2**20  # now the RSS
