"""Run under torchrun (2 ranks): two AdamW steps of a tensor-parallel model (TP 2: weights on the
(shard, tp) mesh, norms on the shard mesh) with the fused AdamW, then with the foreach one, from the
same weights; writes their largest difference and whether the fused one was used as JSON.

Usage: ``fused_adamw_tp.py MODEL_DIR OUT.json``. On the CPU the fused kernel is the CPU's; what the
test checks is that one fused call takes DTensors of two meshes, which is the same on CUDA.
"""

import json
import sys

import torch
import torch.distributed as dist

from rl2gem.parallel.fsdp import full_state_dict, init_distributed, load_sharded
from rl2gem.parallel.mesh import build_mesh
from rl2gem.procs import run_main
from rl2gem.training import token_logprobs


def trained(model_dir: str, mesh, device, fused: bool) -> tuple[dict[str, torch.Tensor], float, list[str]]:
    """The full weights after two steps, how far they moved, and the trained parameters' mesh dimensions."""
    model = load_sharded(model_dir, mesh.data_mesh, device=device, tp_mesh=mesh.tp_mesh)
    start = full_state_dict(model)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-2, fused=fused or None)
    for _ in range(2):
        logprobs, _ = token_logprobs(model, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], device)
        (-logprobs.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(group["fused"] is (True if fused else None) for group in optimizer.param_groups)
    meshes = sorted({",".join(p.device_mesh.mesh_dim_names) for p in parameters})
    weights = full_state_dict(model)
    return weights, max(float((weights[k] - start[k]).abs().max()) for k in weights), meshes


def main(model_dir: str, out: str) -> None:
    rank, _, device = init_distributed()
    mesh = build_mesh(1, 2, 1)
    fused, moved, meshes = trained(model_dir, mesh, device, fused=True)
    plain, _, _ = trained(model_dir, mesh, device, fused=False)
    if rank == 0:
        difference = max(float((fused[k] - plain[k]).abs().max()) for k in plain)
        with open(out, "w") as f:
            json.dump({"difference": difference, "meshes": meshes, "moved": moved}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(lambda: main(*sys.argv[1:]))
