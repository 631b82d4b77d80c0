"""Packed forwards: the step's sequences over data-parallel ranks and micro-batches, and the
per-token quantities every trainer computes from one packed row.

A micro-batch is one row of concatenated sequences (no padding) whose ``position_ids`` restart at
0 for every sequence: flash-attn's varlen kernels get the boundaries from the host plan on GPU
(``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``); other attention gets a block-diagonal
causal mask (:mod:`rl2gem.parallel.packing`). A model sharded
over sequence-parallel ranks runs on its ZigZag share of the row and a model split over
tensor-parallel ranks keeps its logits sharded over the vocabulary; both return the whole row's
per-token results on every rank, equal to one rank's (:mod:`rl2gem.parallel.ring_attention`,
:mod:`rl2gem.parallel.tensor_parallel`).

Per-token outputs of a packed row of ``N`` tokens are float32 ``[N]`` aligned to the input
positions: entry ``t`` belongs to token ``t`` (its log-probability given the tokens before it),
and the first token of each sequence gets 0 (nothing predicts it).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rl2gem.algorithms import entropy_from_logits
from rl2gem.devices import to_device
from rl2gem.models import resolve_dtype, resolve_master_dtype
from rl2gem.parallel.attention import IMPLEMENTATIONS, attention_mask, reads_sequence_boundaries, resolve_attention
from rl2gem.parallel.fsdp import launched_world_size
from rl2gem.parallel.packing import packed_batch, tree_batch
from rl2gem.parallel.ring_attention import gather_sequence_parallel, ring_context, zigzag_layout
from rl2gem.parallel.tensor_parallel import check_tp, vocab_parallel_logprobs
from rl2gem.training.metrics import SavedTensorBytes, simulated_memory_bytes
from rl2gem.training.settings import WorkerSettings, is_length_setting, resolve_compile

__all__ = [
    "PACKINGS",
    "check_packing",
    "check_attention",
    "packed_inputs",
    "token_logprobs",
    "takes_logits_to_keep",
    "token_values",
    "sequence_scores",
    "score_positions",
    "sequence_ends",
    "sequence_sums",
]


#: ``actor.packing``: one row of concatenated sequences, or their prefix tree (shared prefixes once).
PACKINGS = ("flat", "tree")


def check_packing(actor) -> bool:
    """``actor.packing`` checked; True for ``tree``.

    Raises:
        rl2gem.config.ConfigError: an unknown value, or ``tree`` with ``actor.sp_size > 1``.
    """
    from rl2gem.config import ConfigError

    settings = WorkerSettings.from_section(actor)
    packing = settings.packing
    if packing not in PACKINGS:
        raise ConfigError(f"actor.packing={packing!r} is not one of {list(PACKINGS)}")
    if packing == "tree" and int(settings.sp_size) > 1:
        raise ConfigError("actor.packing=tree does not combine with actor.sp_size > 1 (ring attention); use flat")
    return packing == "tree"


def check_attention(actor) -> str:
    """``actor.attention`` checked against the rest of the section and this machine's device (before
    anything loads; :func:`rl2gem.parallel.attention.resolve_attention`); returns it.

    Raises:
        rl2gem.config.ConfigError: what ``resolve_attention`` refuses (an unknown value, ``flex``
            without CUDA, ``flash`` with ``actor.packing=tree``, without CUDA or flash-attn), or
            anything but ``auto`` with ``actor.sp_size > 1`` (ring attention has its own kernel).
    """
    from rl2gem.config import ConfigError

    settings = WorkerSettings.from_section(actor)
    attention = settings.attention
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolve_attention(attention, device, tree=settings.packing == "tree")
    except ValueError as error:
        raise ConfigError(f"actor.{error}") from None
    if attention != "auto" and int(settings.sp_size) > 1:
        raise ConfigError(f"actor.attention={attention} with actor.sp_size > 1: ring attention is used; leave it auto")
    return attention


def check_actor(actor) -> None:
    """``actor.dtype``, ``actor.master_dtype`` (:func:`rl2gem.models.resolve_master_dtype`), ``actor.compile``,
    ``actor.max_length_per_device``, ``actor.cpu_max_length_per_device`` and the optimizer's, schedule's,
    mesh's and LoRA's values (:meth:`~rl2gem.training.settings.WorkerSettings.problems`) checked
    before anything loads; the mesh's sizes against torchrun's world size, and with ``tp_size`` > 1
    a model folder's ``config.json`` against the tensor-parallel plan (:func:`rl2gem.parallel.tensor_parallel.check_tp`).

    Raises:
        rl2gem.config.ConfigError: an unknown dtype name, a master dtype less precise than the
            compute dtype, a ``compile`` that is not a bool or ``auto``, or a length that is neither a positive integer nor ``auto``.
    """
    from rl2gem.config import ConfigError

    try:
        settings = WorkerSettings.from_section(actor)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"actor: {error}") from None
    problems = settings.problems()
    if problems:
        raise ConfigError(f"actor.{problems[0]}")
    world = launched_world_size()
    inner = settings.ddp_size * settings.sp_size * settings.tp_size
    if world % inner:
        raise ConfigError(
            f"actor.ddp_size * actor.sp_size * actor.tp_size = {settings.ddp_size} * {settings.sp_size} * "
            f"{settings.tp_size} does not divide the world size {world}"
        )
    model = actor.get("model")
    if settings.tp_size > 1 and isinstance(model, str) and (Path(model).expanduser() / "config.json").is_file():
        try:  # a folder's config.json read without the weights; check_tp runs again once the model loads
            check_tp(AutoConfig.from_pretrained(Path(model).expanduser()), settings.tp_size)
        except ValueError as error:  # its message starts with the key
            raise ConfigError(str(error)) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolve_master_dtype(settings.master_dtype, resolve_dtype(settings.dtype, device), trainable=True)
        resolve_compile(settings, device)
    except ValueError as error:  # its message starts with the key
        raise ConfigError(f"actor.{error}") from None
    length = settings.max_length_per_device
    if not is_length_setting(length):
        raise ConfigError(f"actor.max_length_per_device: expected a positive int or auto, got {length!r}")
    cpu_length = settings.cpu_max_length_per_device
    if cpu_length is not None and (cpu_length == "auto" or not is_length_setting(cpu_length)):
        raise ConfigError(f"actor.cpu_max_length_per_device: expected a positive int or null, got {cpu_length!r}")


def packed_inputs(model, sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[dict, dict]:
    """One packed row of ``sequences`` and the model's keyword arguments.

    Returns:
        ``(batch, kwargs)``: ``batch`` from :func:`rl2gem.parallel.packing.packed_batch` (host
        tensors: ``input_ids`` / ``position_ids`` ``[1, N]`` int64, ``cu_seqlens`` ``[S + 1]``
        int32, ``until`` ``[N]`` int64); ``kwargs`` for ``model(**kwargs)`` on ``device``: the ids
        and positions, and the mask of the model's attention
        (:func:`rl2gem.parallel.attention.attention_mask`: for flash-attn the sequence boundaries
        instead, ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``; a FlexAttention
        ``BlockMask``, or an additive ``[1, 1, N, N]`` mask), built on the device.
    """
    batch = packed_batch([list(s) for s in sequences])
    return batch, _model_inputs(model, batch, device)


def _model_inputs(model, row: dict, device: torch.device) -> dict:
    """``model(**kwargs)``'s arguments for a row of :func:`~rl2gem.parallel.packing.packed_batch` or
    :func:`~rl2gem.parallel.packing.tree_batch`: ids, positions and the mask (for flash-attn the
    sequence boundaries instead) on ``device``."""
    kwargs = {
        "input_ids": to_device(row["input_ids"], device),
        "position_ids": to_device(row["position_ids"], device),
        "use_cache": False,
    }
    if reads_sequence_boundaries(model):  # flash-attn: the boundaries, not a mask
        boundaries = row["cu_seqlens"]
        longest = int(boundaries.diff().max())  # a host tensor: no device read
        kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = to_device(boundaries, device)
        kwargs["max_length_q"] = kwargs["max_length_k"] = longest
        return kwargs
    mask = attention_mask(model, to_device(row["until"], device))
    if mask is not None:
        kwargs["attention_mask"] = mask
    return kwargs


def _first_token(batch: dict, device: torch.device) -> torch.Tensor:
    return to_device(batch["position_ids"][0], device) == 0


def _next_tokens(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's successor in its sequence (``[N]`` int64; 0 at a sequence's last token)."""
    following = torch.cat([ids[1:], ids.new_zeros(1)])
    last = torch.cat([positions[1:] == 0, positions.new_ones(1, dtype=torch.bool)])
    return following.masked_fill(last, 0)


def _packed_forward(
    model,
    sequences: Sequence[Sequence[int]],
    device: torch.device,
    per_token,
    tree: bool = False,
    needed: Sequence[Sequence[int]] | None = None,
):
    """Run ``model`` on one packed row of ``sequences`` and return ``per_token(output, next_ids,
    rows)`` for every token of the row, in packed order (``[N, ...]``; a tuple of tensors, some of
    which may be None, is handled element-wise), together with the packed batch.

    ``per_token`` gets the model output of the tokens this rank ran and their successors
    (:func:`_next_tokens`), with ``rows`` None: output row ``t`` belongs to token ``t``. With
    ``tree`` the model runs on the prefix tree of ``sequences``
    (:func:`rl2gem.parallel.packing.tree_batch`: shared prefixes once) and ``rows`` ``[N]`` int64
    gives the output row of each token of the flat row, so ``per_token`` reads row ``rows[t]`` for
    token ``t`` (several tokens may share a row; their successors may differ). The results equal
    the flat row's (same positions, same visible tokens). Without sequence parallelism that is the whole row. With it
    (``model.rl2_sp_group``), the row is split ZigZag over the group
    (:func:`rl2gem.parallel.ring_attention.zigzag_layout`), the model runs ring attention on
    this rank's share, and the per-token results of all ranks are gathered back (differentiably)
    so that every rank returns the whole row's results, as one rank would.

    ``needed`` (one 0/1 list per sequence, e.g. the action masks) names the tokens whose results
    are wanted. The model then computes its head (the LM head's ``[V, H]`` GEMM, the log-softmax)
    only at the positions that predict them (transformers' ``logits_to_keep``), ``per_token``
    sees only those, and every other token gets 0. Without sequence parallelism only, and only
    where the model's ``forward`` takes ``logits_to_keep``; otherwise every position is computed.
    """
    limit = simulated_memory_bytes()
    if limit is not None and torch.is_grad_enabled() and not SavedTensorBytes.active:
        with SavedTensorBytes(limit):  # a drill: RL2GEM_SIMULATED_MEMORY_MIB (rl2gem.training.autosize)
            return _packed_forward(model, sequences, device, per_token, tree, needed)
    group = getattr(model, "rl2_sp_group", None)
    if needed is not None and (group is not None or not takes_logits_to_keep(model)):
        needed = None
    if tree:
        return _tree_forward(model, sequences, device, per_token, group, needed)
    if group is None:
        batch, kwargs = packed_inputs(model, sequences, device)
        next_ids = _next_tokens(kwargs["input_ids"][0], kwargs["position_ids"][0])
        if needed is None:
            return per_token(model(**kwargs), next_ids, None), batch
        kept = to_device(_predicting(needed, batch["position_ids"][0]), device)
        output = model(**kwargs, logits_to_keep=kept)
        return _scatter(per_token(output, next_ids[kept], None), kept, next_ids.numel()), batch
    batch = packed_batch([list(s) for s in sequences])
    ids = batch["input_ids"][0]
    layout = zigzag_layout([len(s) for s in sequences], dist.get_world_size(group))
    rank = dist.get_rank(group)
    padded_ids = layout.pad(ids)
    local_ids = to_device(layout.local(padded_ids, rank), device)
    local_positions = to_device(layout.local(layout.positions, rank), device)
    local_next = to_device(layout.local(_next_tokens(padded_ids, layout.positions), rank), device)
    with ring_context(layout, group):
        output = model(input_ids=local_ids[None], position_ids=local_positions[None], use_cache=False)
    local = per_token(output, local_next, None)
    if isinstance(local, tuple):
        return tuple(None if t is None else gather_sequence_parallel(t, layout, group) for t in local), batch
    return gather_sequence_parallel(local, layout, group), batch


def takes_logits_to_keep(model) -> bool:
    """Whether ``model`` (or the model a ``peft`` wrapper adapts) has transformers'
    ``logits_to_keep`` argument (most causal LMs since transformers 4.50)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _predicting(needed: Sequence[Sequence[int]], positions: torch.Tensor) -> torch.Tensor:
    """``[K]`` int64: the packed positions whose successor in the same sequence is a needed token."""
    wanted = torch.tensor([bool(x) for row in needed for x in row], dtype=torch.bool, device=positions.device)
    if wanted.numel() != positions.numel():
        raise ValueError(f"needed has {wanted.numel()} entries for {positions.numel()} tokens")
    successor = torch.cat([wanted[1:], wanted.new_zeros(1)])
    successor &= torch.cat([positions[1:] != 0, positions.new_zeros(1, dtype=torch.bool)])
    return successor.nonzero().squeeze(1)


def _scatter(results, kept: torch.Tensor, n: int):
    """``per_token``'s results for the ``kept`` positions -> ``[n, ...]`` with 0 elsewhere (a tuple
    element-wise, None kept)."""
    if isinstance(results, tuple):
        return tuple(None if r is None else _scatter(r, kept, n) for r in results)
    out = results.new_zeros((n, *results.shape[1:]))
    return out.index_put((kept,), results)


def _tree_forward(model, sequences, device, per_token, group, needed=None):
    """The ``tree=True`` branch of :func:`_packed_forward` (see there)."""
    if group is not None:
        raise ValueError("prefix-tree packing (actor.packing=tree) does not combine with sp_size > 1")
    if getattr(getattr(model, "config", None), "_attn_implementation", "") == IMPLEMENTATIONS["flash"]:
        raise ValueError("prefix-tree packing needs an attention mask: use attention=flex or block, not flash")
    batch = packed_batch([list(s) for s in sequences])
    tree = tree_batch([list(s) for s in sequences])
    inputs = _model_inputs(model, tree, device)
    flat_ids, flat_positions = to_device(batch["input_ids"][0], device), to_device(batch["position_ids"][0], device)
    next_ids, node_of = _next_tokens(flat_ids, flat_positions), to_device(tree["node_of"], device)
    if needed is None:
        return per_token(model(**inputs), next_ids, node_of), batch
    kept_host = _predicting(needed, batch["position_ids"][0])
    # the tree nodes whose logits are read, found on the host (on CUDA ``unique`` reads its size back)
    nodes, rows = (to_device(t, device) for t in torch.unique(tree["node_of"][kept_host], return_inverse=True))
    kept = to_device(kept_host, device)
    output = model(**inputs, logits_to_keep=nodes)
    return _scatter(per_token(output, next_ids[kept], rows), kept, next_ids.numel()), batch


def _shift_to_tokens(next_values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Values computed at each position for its successor, moved to the successor: entry ``t`` of
    the result is ``next_values[t - 1]``, and 0 at each sequence's first token."""
    out = torch.cat([next_values.new_zeros(1), next_values[:-1]])
    return torch.where(_first_token(batch, out.device), torch.zeros_like(out), out)


def token_logprobs(
    model,
    sequences: Sequence[Sequence[int]],
    device: torch.device,
    *,
    temperature: float = 1.0,
    entropy: str = "none",
    tree: bool = False,
    needed: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities (and entropies) of a packed micro-batch under a causal LM.

    Under tensor parallelism (``model.rl2_tp_group``) the LM head's logits stay sharded over the
    vocabulary and :func:`rl2gem.parallel.tensor_parallel.vocab_parallel_logprobs` reduces them;
    under sequence parallelism see :func:`_packed_forward`. Both give what one rank computes.

    Args:
        sequences: token id lists.
        temperature: the logits are divided by it (the sampling temperature of the rollout, so
            the log-probs are those of the distribution that sampled).
        entropy: ``"grad"`` (differentiable, for an entropy bonus), ``"metric"`` (detached) or
            ``"none"``.
        tree: run the prefix tree of ``sequences`` (shared prefixes once; see
            :func:`_packed_forward`); the same results as the flat row.
        needed: one 0/1 list per sequence (the action masks): only these tokens' log-probs and
            entropies are computed (the LM head runs at the positions predicting them); the
            others are 0. The same values at the needed tokens as without it. Ignored under
            tensor or sequence parallelism.

    Returns:
        ``(logprobs [N] float32, entropies [N] float32 in nats or None)``; 0 at each sequence's
        first token.

    Raises:
        ValueError: ``tree`` with sequence parallelism or with flash-attention 2 on GPU.
    """
    tp_group = getattr(model, "rl2_tp_group", None)

    def per_token(output, next_ids, rows):
        logits = output.logits[0].float()
        if temperature != 1.0:  # a [tokens, vocab] float32 pass less each way when it is 1
            logits = logits / temperature
        entropies = None
        if rows is not None and tp_group is None:  # a tree: normalise each node once, read it per token
            logprobs = torch.log_softmax(logits, -1)[rows, next_ids]
            if entropy != "none":
                with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                    entropies = entropy_from_logits(logits if entropy == "grad" else logits.detach())[rows]
            return logprobs, entropies
        if rows is not None:
            logits = logits[rows]
        if tp_group is not None:
            logprobs, entropies = vocab_parallel_logprobs(logits, next_ids, tp_group, entropy=entropy == "grad")
            if entropy == "metric":
                with torch.no_grad():
                    _, entropies = vocab_parallel_logprobs(logits.detach(), next_ids, tp_group, entropy=True)
            return logprobs, entropies
        logprobs = torch.log_softmax(logits, -1).gather(1, next_ids[:, None]).squeeze(1)
        if entropy != "none":
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                entropies = entropy_from_logits(logits if entropy == "grad" else logits.detach())
        return logprobs, entropies

    if tp_group is not None:  # the vocabulary-parallel head reads every position
        needed = None
    (logprobs, entropies), batch = _packed_forward(model, sequences, device, per_token, tree=tree, needed=needed)
    return _shift_to_tokens(logprobs, batch), None if entropies is None else _shift_to_tokens(entropies, batch)


def token_values(
    critic, sequences: Sequence[Sequence[int]], device: torch.device, *, tree: bool = False
) -> torch.Tensor:
    """Per-token values of a packed micro-batch under a value-head model: float32 ``[N]`` where
    entry ``t`` is V(state before token ``t``), read from the hidden state at ``t - 1`` (0 at each
    sequence's first token), aligned like :func:`token_logprobs`."""
    values, batch = _packed_forward(critic, sequences, device, _rows(lambda output: output.logits[0, :, 0]), tree=tree)
    return _shift_to_tokens(values, batch)


def _rows(scalar):
    """A ``per_token`` of :func:`_packed_forward` from ``scalar(output)`` ``[rows]``: float32, one
    value per output row, read per token."""
    return lambda output, _next, rows: scalar(output).float() if rows is None else scalar(output).float()[rows]


def score_positions(sequences: Sequence[Sequence[int]], pad_token_id: int | None = None) -> list[int]:
    """Where each sequence's score is read in the packed row: its last token, or with
    ``pad_token_id`` the last token that is not that id (transformers' ``*ForSequenceClassification``
    pooling: a model exported with the padding token its training skipped is scored as trained;
    the first token when every token is padding)."""
    positions, start = [], 0
    for ids in sequences:
        last = len(ids) - 1
        if pad_token_id is not None:
            last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_token_id), 0)
        positions.append(start + last)
        start += len(ids)
    return positions


def sequence_scores(
    model, sequences: Sequence[Sequence[int]], device: torch.device, pad_token_id: int | None = None
) -> torch.Tensor:
    """Scalar scores of a packed micro-batch under a reward model: float32 ``[S]``, the model's
    one-label output at :func:`score_positions` (by default each sequence's last token: for a
    finished reply its end-of-turn token, so a reply cut off before it scores apart; the trainer's
    reading); differentiable when grad is enabled.

    ``model`` is a token classifier with one label (the trained ``head="reward"`` worker) or a
    sequence classifier with one label (its Hugging Face export), whose per-token head outputs
    are read through a forward hook on ``model.score``.

    Raises:
        ValueError: a model without a one-label ``score`` head.
    """
    head = getattr(model, "score", None)
    if head is None or getattr(head, "out_features", None) != 1:
        raise ValueError(f"{type(model).__name__} has no one-label score head (a reward model)")
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        per_token, _ = _packed_forward(
            model,
            sequences,
            device,
            _rows(lambda output: (output.logits if output.logits.dim() == 3 else captured[-1])[0, :, 0]),
        )
    finally:
        handle.remove()
    positions = to_device(torch.tensor(score_positions(sequences, pad_token_id)), per_token.device)
    return per_token[positions]


def sequence_sums(values: torch.Tensor, lengths: Sequence[int], masks: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per-sequence sums of packed per-token ``values`` ``[N]`` over each sequence's ``mask``:
    ``[S]`` in ``values``' dtype, differentiable (e.g. sequence log-probs of the response tokens)."""
    mask = to_device(torch.tensor([m for ms in masks for m in ms], dtype=values.dtype), values.device)
    owner = to_device(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths))), values.device)
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, owner, values * mask)


def sequence_ends(lengths: Sequence[int]) -> list[int]:
    """Positions of each sequence's last token in the packed row (``cumsum(lengths) - 1``)."""
    ends, total = [], 0
    for n in lengths:
        total += int(n)
        ends.append(total - 1)
    return ends
