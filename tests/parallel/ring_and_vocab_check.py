"""Run under torchrun (2 or more ranks, gloo): the sequence- and tensor-parallel kernels against
single-process references, each rank writing its largest errors to ``OUT.rank<r>.json``.

* ring attention (:func:`rl2gem.parallel.ring_attention.ring_attention`) on several packings
  (sequences shorter than ``2 * sp`` tokens, of one token, longer than the others together)
  against ``scaled_dot_product_attention`` with a block-diagonal causal mask: outputs and the
  gradients of queries, keys and values;
* vocabulary-parallel log-probs (with and without entropies) against ``log_softmax`` on the full
  logits: values and the gradient of each rank's shard.

Usage: ``ring_and_vocab_check.py OUT``.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl2gem.parallel.ring_attention import gather_sequence_parallel, ring_attention, zigzag_layout
from rl2gem.parallel.tensor_parallel import vocab_parallel_logprobs
from rl2gem.procs import run_main

PACKINGS = [[3, 17, 9, 1, 40], [2], [64], [1, 1, 1, 5, 33, 7]]


def ring_errors(lengths, rank, world, generator):
    n, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(1, heads, n, dim, generator=generator)
    k = torch.randn(1, kv_heads, n, dim, generator=generator)
    v = torch.randn(1, kv_heads, n, dim, generator=generator)
    weights = torch.randn(1, n, heads, dim, generator=generator)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seg[:, None] == seg[None]) & torch.ones(n, n, dtype=torch.bool).tril()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    groups = heads // kv_heads
    reference = F.scaled_dot_product_attention(
        qr, kr.repeat_interleave(groups, 1), vr.repeat_interleave(groups, 1), attn_mask=allowed
    ).transpose(1, 2)
    (reference * weights).sum().backward()

    layout = zigzag_layout(lengths, world)

    def local(t):  # [1, h, N, d] -> this rank's [1, h, n_local, d], a leaf
        return layout.local(layout.pad(t[0].transpose(0, 1)), rank).transpose(0, 1)[None].clone().requires_grad_()

    ql, kl, vl = local(q), local(k), local(v)
    out = gather_sequence_parallel(ring_attention(ql, kl, vl, layout, dist.group.WORLD)[0], layout, dist.group.WORLD)
    (out[None] * weights).sum().backward()

    def full(grad):  # this rank's gradient shards gathered back; every rank ran the same loss
        gathered = gather_sequence_parallel(grad[0].transpose(0, 1).contiguous(), layout, dist.group.WORLD)
        return gathered.transpose(0, 1)[None] / world

    return {
        "out": (out[None] - reference).abs().max().item(),
        "dq": (full(ql.grad) - qr.grad).abs().max().item(),
        "dk": (full(kl.grad) - kr.grad).abs().max().item(),
        "dv": (full(vl.grad) - vr.grad).abs().max().item(),
    }


def vocab_errors(rank, world, generator):
    tokens, vocab = 37, 24 * world
    logits = torch.randn(tokens, vocab, generator=generator) * 3
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    weights = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)
    full = logits.clone().requires_grad_()
    logprobs = torch.log_softmax(full, -1)
    ref_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
    ref_h = -(logprobs.exp() * logprobs).sum(-1)
    ((ref_lp * weights[0]).sum() + (ref_h * weights[1]).sum()).backward()
    width = vocab // world
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, h = vocab_parallel_logprobs(shard, targets, dist.group.WORLD, entropy=True)
    ((lp * weights[0]).sum() + (h * weights[1]).sum()).backward()
    errors = {
        "logprobs": (lp - ref_lp).abs().max().item(),
        "entropy": (h - ref_h).abs().max().item(),
        "grad": (shard.grad - full.grad[:, rank * width : (rank + 1) * width]).abs().max().item(),
    }
    # without entropies: the memory-saving function with its own backward
    full.grad = None
    (torch.log_softmax(full, -1).gather(1, targets[:, None]).squeeze(1) * weights[0]).sum().backward()
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, none = vocab_parallel_logprobs(shard, targets, dist.group.WORLD)
    (lp * weights[0]).sum().backward()
    assert none is None
    errors["logprobs_only"] = (lp - ref_lp).abs().max().item()
    errors["grad_logprobs_only"] = (shard.grad - full.grad[:, rank * width : (rank + 1) * width]).abs().max().item()
    # a -inf logit (a masked token) at each rank's first id, where the other ranks' targets clamp
    masked = logits.clone()
    masked[:, ::width] = float("-inf")
    targets = targets.where(targets % width != 0, targets + 1)
    reference = torch.log_softmax(masked, -1).gather(1, targets[:, None]).squeeze(1)
    for entropy in (False, True):
        lp, _ = vocab_parallel_logprobs(
            masked[:, rank * width : (rank + 1) * width], targets, dist.group.WORLD, entropy=entropy
        )
        errors[f"logprobs_minus_inf_entropy_{entropy}"] = (lp - reference).abs().max().nan_to_num(float("inf")).item()
    return errors


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    result = {"ring": [ring_errors(lengths, rank, world, generator) for lengths in PACKINGS]}
    result["vocab"] = vocab_errors(rank, world, generator)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(lambda: main(*sys.argv[1:]))
