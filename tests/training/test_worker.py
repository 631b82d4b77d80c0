"""setup_distributed's CPU threads, in a fresh process each (the count is process-wide), and the
workers' AdamW under tensor parallelism."""

import json
import os
import subprocess
import sys

import torch
from helpers import ROOT, torchrun

from rl2gem.training.worker import fused_adamw

# After setup_distributed: the intra-op threads of the main thread and of a thread started later
# (as the embedded engine's is), once that thread ran a parallel op.
PROBE = """
import json, os, sys, threading, torch
from rl2gem.training import setup_distributed
os.cpu_count = lambda: int(sys.argv[1])  # the node's CPUs, as the test says
setup_distributed(0, {})
seen = {}
def compute():
    torch.ones(1 << 22).add_(1)
    seen["thread"] = torch.get_num_threads()
thread = threading.Thread(target=compute)
thread.start()
thread.join()
print(json.dumps({"main": torch.get_num_threads(), **seen}))
"""


def probe(omp: str | None, local: str, cpus: int = 8) -> dict:
    dropped = (
        "OMP_NUM_THREADS",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )  # an earlier test's group
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["LOCAL_WORLD_SIZE"] = local
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", PROBE, str(cpus)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_rank_keeps_a_set_omp_num_threads_in_every_thread():
    """With one rank per node a set OMP_NUM_THREADS wins over the node's CPUs: the test workers'
    1 thread each stays 1 (before, a one-process run took all the CPUs, and the engine's thread
    spun up a team that made tests up to 70x slower on the 2-core CI machine)."""
    got = probe("1", "1")
    assert got["main"] == got["thread"] == 1
    assert probe(None, "1")["main"] == 8  # unset: every CPU


def test_each_local_rank_gets_its_share_of_the_cpus():
    """With several ranks per node, OMP_NUM_THREADS=1 is torchrun's own default: each rank takes
    its share of the node's CPUs whether it is set or not."""
    for omp in ("1", None):
        got = probe(omp, "2")
        assert got["main"] == got["thread"] == 4
    assert probe(None, "3", cpus=2)["main"] == 1  # at least one


def test_the_fused_adamw_steps_tensor_parallel_weights_as_the_foreach_one(tiny_dir, tmp_path):
    """One fused AdamW call over DTensors on two meshes (TP weights and FSDP-only norms) gives the
    foreach AdamW's weights, so the trainers use it under tensor parallelism too (:func:`fused_adamw`)."""
    out = tmp_path / "fused.json"
    torchrun(2, str(ROOT / "tests" / "parallel" / "fused_adamw_tp.py"), str(tiny_dir), str(out))
    result = json.loads(out.read_text())
    assert result["meshes"] == ["shard", "shard,tp"]
    assert result["moved"] > 1e-3 and result["difference"] < 1e-6
    assert not fused_adamw([torch.nn.Parameter(torch.ones(2))])  # the CPU keeps torch's default
