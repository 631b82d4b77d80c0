"""Run under torchrun: loss and gradients of FSDP2 over N ranks equal one process's (written as JSON).

Usage: ``fsdp_equivalence.py MODEL_DIR OUT.json [ddp_size=N] [cpu_offload=1] [gradient_checkpointing=1]``.
"""

import json
import sys

import torch
import torch.distributed as dist

from rl2gem.algorithms import policy_loss
from rl2gem.parallel.fsdp import device_mesh, full_state_dict, init_distributed, load_sharded
from rl2gem.parallel.packing import plan



def main(model_dir: str, out: str, *options: str) -> None:
    opts = dict(o.split("=", 1) for o in options)
    rank, world, device = init_distributed()
    torch.manual_seed(0)
    model = load_sharded(model_dir, device_mesh(int(opts.get("ddp_size", 1))), device=device,
                         cpu_offload=bool(int(opts.get("cpu_offload", 0))),
                         gradient_checkpointing=bool(int(opts.get("gradient_checkpointing", 0))))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (7,), generator=g)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    advs = [[float(i % 3 - 1)] * len(s) for i, s in enumerate(seqs)]
    total = float(sum(sum(m) for m in masks))
    mbs = plan([len(s) for s in seqs], world, 64)[rank]
    from rl2gem.trainers.ppo import Sample, token_logprobs, token_weights

    samples = [Sample(s, m, [0.0] * len(s), a, [0.0] * len(s), [0] * len(s)) for s, m, a in zip(seqs, masks, advs)]
    loss_sum = torch.zeros(())
    for mb in mbs:
        part = [samples[i] for i in mb] or [samples[0]]
        lp, _ = token_logprobs(model, part, 1.0, device)
        old = lp.detach() + 0.05
        mask = torch.tensor([x for s in part for x in s.mask], dtype=torch.bool)
        adv = torch.tensor([x for s in part for x in s.adv])
        w = token_weights(part, "token_mean", 1.0, {"tokens": total, "seqs": float(len(seqs))}) * (1.0 if mb else 0.0)
        loss, _ = policy_loss(lp[None], old[None], adv[None], mask[None], token_weights=w[None])
        (loss * world).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    grads = {}
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        gr = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = gr.flatten()[:50].tolist() + [float(gr.norm())]
    params = {k: float(v.norm()) for k, v in full_state_dict(model).items()}  # a collective: every rank
    if rank == 0:
        json.dump({"loss": float(loss_sum), "grads": grads, "params": params}, open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
