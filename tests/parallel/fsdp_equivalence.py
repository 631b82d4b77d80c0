"""Run under torchrun: loss and gradients of FSDP2 over N ranks equal one process's (written as JSON).

Usage: ``fsdp_equivalence.py MODEL_DIR OUT.json [ddp_size=N] [tp_size=N] [sp_size=N] [cpu_offload=1]
[gradient_checkpointing=1] [max_tokens=N] [lengths=a,b,c] [lora=RANK]``. With ``lora`` the adapters
start random (``B`` too, so that every adapter parameter has a gradient) and only they train.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rl2gem.algorithms import packed_loss_weights, policy_loss
from rl2gem.parallel.fsdp import full_state_dict, init_distributed, load_sharded
from rl2gem.parallel.mesh import build_mesh
from rl2gem.procs import run_main
from rl2gem.training import plan_micro_batches, token_logprobs
from rl2gem.training.lora import inject, lora_config


def main(model_dir: str, out: str, *options: str) -> None:
    opts = dict(o.split("=", 1) for o in options)
    rank, world, device = init_distributed()
    torch.manual_seed(0)
    mesh = build_mesh(int(opts.get("ddp_size", 1)), int(opts.get("tp_size", 1)), int(opts.get("sp_size", 1)))
    adapt = None
    if "lora" in opts:
        config = lora_config({"rank": int(opts["lora"]), "alpha": 16.0})
        config.init_lora_weights = False  # random B: the model differs from the base, A gets gradients

        def adapt(model):
            inject(model, config)

    model = load_sharded(
        model_dir,
        mesh.data_mesh,
        device=device,
        tp_mesh=mesh.tp_mesh,
        sp_group=mesh.sp_group,
        cpu_offload=bool(int(opts.get("cpu_offload", 0))),
        gradient_checkpointing=bool(int(opts.get("gradient_checkpointing", 0))),
        adapt=adapt,
    )
    g = torch.Generator().manual_seed(1)
    lengths = (
        [int(n) for n in opts["lengths"].split(",")] if "lengths" in opts else torch.randint(5, 40, (7,), generator=g)
    )
    seqs = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in lengths]
    masks = [[0] * min(3, len(s)) + [1] * max(0, len(s) - 3) for s in seqs]
    advs = [[float(i % 3 - 1)] * len(s) for i, s in enumerate(seqs)]
    total = float(sum(sum(m) for m in masks))
    with torch.no_grad():  # per-token log-probs of the whole batch, and the logits of one sequence
        logprobs = token_logprobs(model, seqs, device)[0]
        logits = None
        if mesh.sp_size == 1:
            logits = model(input_ids=torch.tensor([seqs[0]], device=device), use_cache=False).logits[0]
            if mesh.tp_size > 1:  # the LM head's output stays sharded over the vocabulary
                parts = [torch.empty_like(logits) for _ in range(mesh.tp_size)]
                dist.all_gather(parts, logits.contiguous(), group=model.rl2_tp_group)
                logits = torch.cat(parts, -1)
    loss_sum = torch.zeros(())
    max_tokens = mesh.micro_batch_tokens(int(opts.get("max_tokens", 64)))
    for mb in plan_micro_batches([len(s) for s in seqs], mesh.dp_rank, mesh.dp_size, max_tokens):
        part = [seqs[i] for i in mb.indices]
        lp, _ = token_logprobs(model, part, device)
        old = lp.detach() + 0.05
        mask = torch.tensor([x for i in mb.indices for x in masks[i]], dtype=torch.bool)
        adv = torch.tensor([x for i in mb.indices for x in advs[i]])
        w = mb.scale * packed_loss_weights(
            [masks[i] for i in mb.indices], "token_mean", num_tokens=total, num_sequences=len(seqs)
        )
        loss, _ = policy_loss(lp[None], old[None], adv[None], mask[None], token_weights=w[None])
        (loss * mesh.dp_size).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    loss_sum /= mesh.sp_size * mesh.tp_size  # every sp / tp rank of a data-parallel rank holds its loss
    grads = {}
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        gr = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = gr.flatten()[:50].tolist() + [float(gr.norm())]
    params = {k: float(v.norm()) for k, v in full_state_dict(model).items()}  # a collective: every rank
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "loss": float(loss_sum),
                    "fsdp": isinstance(model, FSDPModule),
                    "grads": grads,
                    "params": params,
                    "logprobs": logprobs.tolist(),
                    "logits": None if logits is None else logits[:, ::97].flatten().tolist(),
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(lambda: main(*sys.argv[1:]))
