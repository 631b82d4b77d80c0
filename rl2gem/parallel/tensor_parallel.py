"""Tensor parallelism (Megatron-LM style, Shoeybi et al. 2019) through PyTorch DTensor.

:func:`parallelize` applies ``torch.distributed.tensor.parallel.parallelize_module`` plans to the
decoder family that shares Llama's module names (Llama, Qwen2, Qwen3, Mistral):

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank holds ``H / tp`` query heads
  and ``H_kv / tp`` key/value heads), ``o_proj`` row-wise (its output all-reduced);
* MLP: ``gate_proj``, ``up_proj`` column-wise, ``down_proj`` row-wise;
* ``embed_tokens``: vocabulary-parallel (rows sharded, out-of-shard ids masked, the output
  all-reduced);
* ``lm_head``: column-wise with its output left sharded over the vocabulary, so the full
  ``[N, V]`` logits are never gathered: :func:`vocab_parallel_logprobs` computes per-token
  log-probabilities and entropies from the shards with three all-reduces of ``[N]`` vectors.

Norms and a value or reward head stay replicated. Qwen3's per-head ``q_norm`` / ``k_norm`` see
only this rank's heads, so they are planned as ``SequenceParallel`` over the head dimension: their
weights are replicated DTensors whose gradients are summed over the tensor-parallel ranks (a plain
replicated copy would keep each rank's part of the gradient, and the copies would drift apart). FSDP2 then shards every parameter over the data
dims (2-D FSDP x TP, :func:`rl2gem.parallel.fsdp.load_sharded`). Tied input and output
embeddings are re-tied after the plan (both are sharded by vocabulary rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl2gem.models import decoder_layers

__all__ = ["TP_MODEL_TYPES", "check_tp", "parallelize", "vocab_parallel_logprobs"]

#: ``config.model_type`` values with a plan.
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def check_tp(config, tp_size: int) -> None:
    """Raise a clear error when ``config``'s model cannot be split over ``tp_size`` ranks.

    Raises:
        ValueError: a model type without a plan, or a head count, key/value head count,
            intermediate size or vocabulary size that ``tp_size`` does not divide.
    """
    if tp_size == 1:
        return
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"actor.tp_size={tp_size}: no tensor-parallel plan for model_type={config.model_type!r} "
            f"(plans exist for {', '.join(TP_MODEL_TYPES)}); use actor.tp_size=1"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for name, value in sizes.items():
        if value % tp_size:
            raise ValueError(f"actor.tp_size={tp_size} does not divide the model's {name}={value}")


def parallelize(model, tp_mesh) -> None:
    """Apply the tensor-parallel plan to ``model`` (a causal LM, token or sequence classifier of a
    :data:`TP_MODEL_TYPES` family) over the 1-D ``tp_mesh``, in place (meta tensors allowed).

    Raises:
        ValueError: see :func:`check_tp`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp(model.config, tp_mesh.size())
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    head_norms = {  # Qwen3: RMSNorm over each head of [batch, tokens, heads, head_dim]
        f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True) for name in ("q_norm", "k_norm")
    }
    for layer in decoder_layers(model):
        has_head_norms = all(getattr(layer.self_attn, name.split(".")[1], None) is not None for name in head_norms)
        parallelize_module(layer, tp_mesh, {**layer_plan, **head_norms} if has_head_norms else layer_plan)
    tied = getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head")
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rl2_tp_group = tp_mesh.get_group()


class _AllReduceSum(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group; the backward is the identity, because
    what follows runs replicated on every rank (Megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard_targets(targets: torch.Tensor, width: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inside [N] bool, local index [N] int64)``: which targets fall in this rank's vocabulary
    slice of ``width`` ids, and where (clamped into the slice for the others)."""
    start = dist.get_rank(group) * width
    return (targets >= start) & (targets < start + width), (targets - start).clamp(0, width - 1)


def _picked(shifted: torch.Tensor, local_target: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``[N]``: each target's shifted logit on the rank that holds it, 0 on the others (not a
    product with ``inside``: a ``-inf`` logit at the clamped index would give NaN)."""
    return torch.where(inside, shifted.gather(1, local_target[:, None]).squeeze(1), 0.0)


class _VocabParallelLogprobs(torch.autograd.Function):
    """Log-probs of targets from vocabulary shards, saving only the local softmax ``[N, V / tp]``
    for the backward (``d logp / d logits = onehot - softmax``), as Megatron's vocab-parallel
    cross-entropy does: the per-rank logits memory is ``1 / tp`` of one rank's."""

    @staticmethod
    def forward(ctx, local_logits, targets, group):
        peak = local_logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = local_logits - peak[:, None]
        inside, local_target = _shard_targets(targets, local_logits.shape[-1], group)
        picked = _picked(shifted, local_target, inside)
        softmax = shifted.exp_()
        total = softmax.sum(-1)
        dist.all_reduce(total, group=group)
        dist.all_reduce(picked, group=group)
        softmax.div_(total[:, None])
        ctx.save_for_backward(softmax, local_target, inside)
        return picked - total.log()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, inside = ctx.saved_tensors
        grad_logits = softmax.mul_(-grad[:, None])
        grad_logits.scatter_add_(1, local_target[:, None], (grad * inside)[:, None])
        return grad_logits, None, None


def vocab_parallel_logprobs(
    local_logits: torch.Tensor, targets: torch.Tensor, group, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` (and entropies) from logits sharded over the vocabulary.

    Args:
        local_logits: float ``[N, V / tp]``, this rank's contiguous slice of the vocabulary
            (rank ``r`` holds ids ``[r * V / tp, (r + 1) * V / tp)``), already divided by any
            temperature.
        targets: int64 ``[N]`` token ids in ``[0, V)``.
        group: the tensor-parallel process group.
        entropy: also return differentiable entropies (autograd through the reductions, which
            keeps more of the ``[N, V / tp]`` intermediates; without it only the local softmax is
            kept for the backward).

    Returns:
        ``(logprobs [N], entropies [N] or None)`` in nats, equal on every rank and differentiable
        with respect to ``local_logits`` (the gradient of each rank's shard).
    """
    if not entropy:
        return _VocabParallelLogprobs.apply(local_logits, targets, group), None
    peak = local_logits.detach().max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = local_logits - peak[:, None]
    exp = shifted.exp()
    total = _AllReduceSum.apply(exp.sum(-1), group)
    inside, local_target = _shard_targets(targets, local_logits.shape[-1], group)
    picked = _picked(shifted, local_target, inside)
    log_total = total.log()
    logprobs = _AllReduceSum.apply(picked, group) - log_total
    expected = _AllReduceSum.apply((exp * shifted).sum(-1), group) / total
    return logprobs, log_total - expected
