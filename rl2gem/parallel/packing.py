"""Balanced sequence packing: partition sequences over data-parallel ranks, pack micro-batches.

A step's sequences are

1. partitioned over the ``world_size`` data-parallel ranks with the
   Karmarkar-Karp largest differencing method (Karmarkar & Karp 1982; k-way
   form as in Korf 1998) on *compute cost*, not token count: attention makes
   a sequence's cost grow as ``L + attn_coef * L**2`` (see :func:`seq_cost`);
2. packed on each rank into micro-batches of at most ``max_tokens`` tokens
   (first-fit decreasing), with no padding: a micro-batch is one row of
   concatenated sequences whose ``position_ids`` restart at 0 for every
   sequence, so attention never crosses sequences (flash-attn varlen on GPU,
   a block-diagonal causal mask on CPU; see :func:`packed_attention_mask`);
3. every rank gets the same number of micro-batches (FSDP collectives must
   match), padding with empty ones: :func:`plan_micro_batches` gives a rank its
   :class:`MicroBatch` list, placeholders included; :func:`plan_pair_micro_batches` plans
   preference pairs whole; :func:`regroup_scores` moves per-token scores to a finer plan
   (after an out-of-memory back-off).

Prefix-tree ("tree") packing (:func:`tree_batch`, :func:`plan_tree`): sequences that share a
prefix (the samples of a GRPO group share the prompt; multi-turn samples often share turns too)
are packed as a trie: every distinct prefix is one token of the row, once, and a token attends to
its ancestors only (:func:`tree_attention_mask`), at ``position_id`` = its depth. Each sequence's
token ``t`` is the trie node of its prefix ``[:t + 1]``, so a causal LM's output at that node is
exactly what the flat row computes for the sequence at ``t`` (same positions, same visible
tokens), while the shared prefix runs once. AReaL packs GRPO groups the same way.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

import torch

from rl2gem.rollout.tito import common_prefix_length

__all__ = [
    "minibatch_bounds",
    "plan_minibatches",
    "seq_cost",
    "karmarkar_karp",
    "pack_micro_batches",
    "plan",
    "packed_batch",
    "packed_attention_mask",
    "visible_until",
    "visibility_mask",
    "unpack",
    "tree_batch",
    "tree_attention_mask",
    "tree_size",
    "plan_tree",
    "MicroBatch",
    "plan_micro_batches",
    "plan_pair_micro_batches",
    "regroup_scores",
]


def seq_cost(length: int, attn_coef: float = 1.0 / 4096) -> float:
    """Relative forward/backward cost of a sequence: ``L + attn_coef * L**2``.

    ``attn_coef`` ~ (attention FLOPs per token pair) / (dense FLOPs per token); 1/4096 makes
    attention as expensive as the dense layers at 4096 tokens.
    """
    return float(length) + attn_coef * float(length) ** 2


def karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """Partition item indices into ``k`` sets with nearly equal cost sums (largest differencing).

    Returns ``k`` lists of indices (some may be empty when there are fewer than ``k`` items).

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    counter = itertools.count()
    heap = []
    for i, c in enumerate(costs):
        sets = [[i]] + [[] for _ in range(k - 1)]
        sums = [float(c)] + [0.0] * (k - 1)
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(counter), sums, sets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        o1 = sorted(range(k), key=lambda j: -s1[j])  # largest first
        o2 = sorted(range(k), key=lambda j: s2[j])  # smallest first
        sums = [s1[a] + s2[b] for a, b in zip(o1, o2, strict=True)]
        sets = [p1[a] + p2[b] for a, b in zip(o1, o2, strict=True)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(counter), sums, sets))
    _, _, sums, sets = heap[0]
    return [sorted(s) for s in sets]


def pack_micro_batches(lengths: list[int], indices: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: ``indices`` into bins whose total length is at most ``max_tokens``.

    Raises:
        ValueError: a sequence longer than ``max_tokens``.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        if lengths[i] > max_tokens:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens > max_length_per_device={max_tokens}")
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def plan(lengths: list[int], world_size: int, max_tokens: int, attn_coef: float = 1.0 / 4096) -> list[list[list[int]]]:
    """Per rank, its micro-batches of sequence indices (same count on every rank; empty ones pad)."""
    parts = karmarkar_karp([seq_cost(n, attn_coef) for n in lengths], world_size)
    per_rank = [pack_micro_batches(lengths, p, max_tokens) for p in parts]
    n = max(1, max(len(m) for m in per_rank))
    return [m + [[] for _ in range(n - len(m))] for m in per_rank]


def packed_batch(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """One packed row (CPU tensors, to be copied to the device once).

    Returns:
        ``input_ids`` and ``position_ids`` ``[1, N]`` int64, ``cu_seqlens`` ``[S + 1]`` int32, and
        ``until`` ``[N]`` int64: each token's sequence's last index (:func:`visible_until`).
    """
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device="cpu")[None]
    pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device="cpu")[None]
    ends = list(itertools.accumulate(lens))
    until = torch.tensor(
        [end - 1 for end, n in zip(ends, lens, strict=True) for _ in range(n)], dtype=torch.long, device="cpu"
    )
    cu = torch.tensor([0, *ends], dtype=torch.int32, device="cpu")
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "until": until}


def visible_until(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 on ``cu_seqlens``' device: for each token of a packed row, the last index of its
    sequence, the last query that sees it (:func:`visibility_mask`)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(cu_seqlens[1:].long() - 1, lengths)


def visibility_mask(until: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The ``[1, 1, N, N]`` attention mask of a row whose key ``k`` is seen by the queries
    ``k..until[k]`` (a packed row: :func:`visible_until`; a prefix tree in depth-first order:
    ``tree_batch(...)["until"]``, the end of each node's subtree), built on ``until``'s device.

    Args:
        until: ``[N]`` int64, ``until[k] >= k``.
        dtype: a floating dtype for an additive mask (0 where a query sees a key, the dtype's
            minimum elsewhere), or None for a boolean mask (True where it sees).
    """
    index = torch.arange(len(until), device=until.device)
    allowed = (index[None, :] <= index[:, None]) & (index[:, None] <= until[None, :])
    if dtype is None:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=until.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def packed_attention_mask(cu_seqlens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Block-diagonal causal additive mask ``[1, 1, N, N]`` (0 allowed, the dtype's minimum
    masked) for sdpa/eager, on ``cu_seqlens``' device."""
    return visibility_mask(visible_until(cu_seqlens), dtype)


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[1, N, ...]`` tensor back into per-sequence tensors."""
    return [x[0, int(a) : int(b)] for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]


def tree_size(seqs: list[list[int]]) -> int:
    """Tokens of the prefix tree of ``seqs``: the number of distinct non-empty prefixes (in sorted
    order, each sequence adds its length minus its common prefix with the one before)."""
    ordered = sorted(seqs)
    return sum(len(s) - (common_prefix_length(s, ordered[i - 1]) if i else 0) for i, s in enumerate(ordered))


def tree_batch(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """One prefix-tree row of ``seqs`` (a trie), nodes in depth-first order, children in the order
    first seen (so, when sequences sharing a prefix are neighbours, the order they first appear).

    Returns:
        ``input_ids`` / ``position_ids`` ``[1, M]`` int64 (``M`` = :func:`tree_size`, position =
        depth), ``parents`` ``[M]`` int64 (-1 at a root), ``until`` ``[M]`` int64 (the last node of
        each node's subtree: node ``k`` is an ancestor of ``q``, or ``q`` itself, exactly when
        ``k <= q <= until[k]``; :func:`visibility_mask`), and ``node_of`` ``[N]`` int64: for each
        token of the flat packing (:func:`packed_batch`, ``N`` = the total length) its node.
    """
    children: list[dict[int, int]] = [{}]  # trie node 0 is a virtual root above the trie's roots
    tokens, flat_nodes = [0], []
    for seq in seqs:
        node = 0
        for token in seq:
            following = children[node].get(token)
            if following is None:
                following = children[node][token] = len(children)
                children.append({})
                tokens.append(token)
            node = following
            flat_nodes.append(node)
    # depth-first renumbering: order[i] is the trie node at row index i
    order, parents, depths, until = [], [], [], []
    stack = [(child, -1, 0) for child in reversed(children[0].values())]
    while stack:
        node, parent, depth = stack.pop()
        index = len(order)
        order.append(node)
        parents.append(parent)
        depths.append(depth)
        stack.extend((child, index, depth + 1) for child in reversed(children[node].values()))
    until = list(range(len(order)))
    for index in range(len(order) - 1, -1, -1):  # children come after their parent
        if parents[index] >= 0:
            until[parents[index]] = max(until[parents[index]], until[index])
    row_of = [0] * len(children)
    for index, node in enumerate(order):
        row_of[node] = index
    return {
        "input_ids": torch.tensor([tokens[node] for node in order], dtype=torch.long, device="cpu")[None],
        "position_ids": torch.tensor(depths, dtype=torch.long, device="cpu")[None],
        "parents": torch.tensor(parents, dtype=torch.long, device="cpu"),
        "until": torch.tensor(until, dtype=torch.long, device="cpu"),
        "node_of": torch.tensor([row_of[node] for node in flat_nodes], dtype=torch.long, device="cpu"),
    }


def tree_attention_mask(parents: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Additive mask ``[1, 1, M, M]`` of a prefix tree: node ``i`` sees itself and its ancestors
    (0), nothing else (the dtype's minimum). ``parents`` must precede their children."""
    m = len(parents)
    allowed = torch.zeros(m, m, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            allowed[i] = allowed[parent]
        allowed[i, i] = True
    return torch.zeros(m, m, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def plan_tree(seqs: list[list[int]], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """:func:`plan` for prefix-tree micro-batches: per rank, its micro-batches of sequence indices.

    Sequences are sorted (so those sharing a prefix are neighbours) and the sorted list is cut into
    ``world_size`` consecutive spans whose largest tree is as small as possible (a span's tree counts
    the prefix it shares with the previous span again, so a group is split over two ranks only where
    that balances the ranks better). Each rank's span is then cut into micro-batches of at most
    ``max_tokens`` tree tokens with the fewest tree tokens in all (a group sharing a prompt is cut
    only if it does not fit), and units that fit together share a micro-batch (first-fit
    decreasing). Every rank gets the same number of micro-batches, padded with empty ones. A
    sequence longer than ``max_tokens`` is refused, as by :func:`plan`.

    Minimising the total tree tokens alone would put every group that shares a system prompt on one
    rank and leave the others idle.

    Raises:
        ValueError: a sequence longer than ``max_tokens``.
    """
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    for i in order:
        if len(seqs[i]) > max_tokens:
            raise ValueError(f"sequence {i} has {len(seqs[i])} tokens > max_length_per_device={max_tokens}")
    # added[k]: the tokens sequence order[k] adds to a tree after order[k - 1]; the unit order[a:b]
    # has len(order[a]) + added[a + 1] + ... + added[b - 1] tree tokens
    added = [
        len(seqs[i]) - (common_prefix_length(seqs[i], seqs[order[k - 1]]) if k else 0) for k, i in enumerate(order)
    ]
    total = list(itertools.accumulate(added, initial=0))

    def size(a: int, b: int) -> int:
        return len(seqs[order[a]]) + total[b] - total[a + 1]

    per_rank = []
    for first, end in _balanced_spans(len(order), world_size, size):
        units = _cheapest_cuts(first, end, size, max_tokens)
        sizes = [size(a, b) for a, b in units]  # units that fit together share a micro-batch
        bins = pack_micro_batches(sizes, list(range(len(units))), max_tokens)
        per_rank.append([sorted(i for u in mb for i in order[units[u][0] : units[u][1]]) for mb in bins])
    depth = max(1, max(map(len, per_rank)))
    return [mbs + [[] for _ in range(depth - len(mbs))] for mbs in per_rank]


def _balanced_spans(n: int, parts: int, size) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering ``0..n`` (empty ones last) whose largest ``size(a, b)``
    (non-decreasing in ``b``) is the smallest possible: a binary search on that bound, each bound
    checked by filling ranges greedily."""

    def greedy(bound: int) -> list[tuple[int, int]]:
        spans, a = [], 0
        while a < n:
            b = a + 1
            while b < n and size(a, b + 1) <= bound:
                b += 1
            spans.append((a, b))
            a = b
        return spans

    if n == 0:
        return [(0, 0)] * parts
    low = max(size(a, a + 1) for a in range(n))
    high = size(0, n)
    while low < high:
        middle = (low + high) // 2
        if len(greedy(middle)) <= parts:
            high = middle
        else:
            low = middle + 1
    spans = greedy(low)
    return spans + [(n, n)] * (parts - len(spans))


def _cheapest_cuts(first: int, end: int, size, max_tokens: int) -> list[tuple[int, int]]:
    """Cuts of the range ``first..end`` into units of at most ``max_tokens`` ``size`` with the
    smallest total size (dynamic programming over the cut points, quadratic in the range; a range
    that fits whole is one unit, as a cut never shrinks the trees; an empty range, none)."""
    if first == end:  # a rank past the spans (fewer trees than ranks): its plan is a placeholder
        return []
    if size(first, end) <= max_tokens:
        return [(first, end)]
    best, cut = {first: 0}, {}
    for b in range(first + 1, end + 1):
        for a in range(b - 1, first - 1, -1):
            unit = size(a, b)
            if unit > max_tokens:
                break
            if b not in best or best[a] + unit < best[b]:
                best[b], cut[b] = best[a] + unit, a
    units, b = [], end
    while b > first:
        units.append((cut[b], b))
        b = cut[b]
    return units[::-1]


@dataclasses.dataclass
class MicroBatch:
    """Indices of the sequences of one micro-batch on this rank.

    Attributes:
        indices: positions in the step's list of sequences.
        placeholder: True for a micro-batch a rank runs only to keep FSDP's collectives matched
            (it got fewer real micro-batches than another rank): it computes on the step's shortest
            sequence and its loss must be multiplied by 0 (:attr:`scale`).
        minibatch: the optimizer step it belongs to (:func:`plan_minibatches`).
    """

    indices: list[int]
    placeholder: bool = False
    minibatch: int = 0

    @property
    def scale(self) -> float:
        """1.0 for a real micro-batch, 0.0 for a placeholder."""
        return 0.0 if self.placeholder else 1.0


def plan_micro_batches(
    lengths: Sequence[int],
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    attn_coef: float = 1.0 / 4096,
    sequences: Sequence[Sequence[int]] | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of a step (the same number on every data-parallel rank).

    Sequences are partitioned over ranks by Karmarkar-Karp on compute cost ``L + attn_coef * L^2``
    and packed into micro-batches of at most ``max(max_tokens, longest)`` tokens
    (:func:`plan`). With ``sequences`` (the token ids, for prefix-tree
    packing) micro-batches are planned on their prefix trees' sizes instead
    (:func:`plan_tree`, ``attn_coef`` unused): each rank gets a span of
    the sorted sequences, the largest rank's tree as small as possible, and a micro-batch keeps a
    shared prefix once. A rank with fewer micro-batches than the busiest rank gets placeholders
    (see :class:`MicroBatch`).

    Raises:
        ValueError: no sequences.
    """
    if not lengths:
        raise ValueError("plan_micro_batches needs at least one sequence")
    limit = max(int(max_tokens), max(lengths))
    if sequences is not None:
        per_rank = plan_tree([list(s) for s in sequences], dp_size, limit)[dp_rank]
    else:
        per_rank = plan(list(lengths), dp_size, limit, attn_coef)[dp_rank]
    shortest = min(range(len(lengths)), key=lambda i: lengths[i])
    return [MicroBatch(list(mb)) if mb else MicroBatch([shortest], placeholder=True) for mb in per_rank]


def regroup_scores(
    scores: Sequence[dict[str, torch.Tensor]],
    old: Sequence[MicroBatch],
    new: Sequence[MicroBatch],
    lengths: Sequence[int],
) -> list[dict[str, torch.Tensor]]:
    """Per-token tensors packed for the micro-batches ``old`` (``scores[j][key]``: ``[sum of the
    lengths of old[j]'s sequences]``), packed again for ``new`` (the same sequences planned with
    another token budget). A sequence of ``new`` that ``old`` did not hold on this rank for real (a
    placeholder's, whose loss is multiplied by 0) gets zeros; an old placeholder's scores are dropped."""
    if [(m.indices, m.placeholder) for m in old] == [(m.indices, m.placeholder) for m in new]:
        return list(scores)
    per_sequence: dict[int, dict[str, torch.Tensor]] = {}
    for mb, packed in zip(old, scores, strict=True):
        if mb.placeholder:  # a pass this rank does not count: a sequence it holds for real keeps its own
            continue
        sizes = [lengths[i] for i in mb.indices]
        for key, tensor in packed.items():
            for i, chunk in zip(mb.indices, tensor.split(sizes), strict=True):
                per_sequence.setdefault(i, {})[key] = chunk
    template = scores[0]
    return [
        {
            key: torch.cat(
                [per_sequence[i][key] if i in per_sequence else template[key].new_zeros(lengths[i]) for i in mb.indices]
            )
            for key in template
        }
        for mb in new
    ]


def minibatch_bounds(count: int, minibatches: int) -> list[int]:
    """Where each of a step's ``minibatches`` optimizer steps starts in its ``count`` sequences,
    and where the last ends: minibatch ``k`` is sequences ``[bounds[k], bounds[k + 1])``
    (:func:`plan_minibatches`' parts; fewer sequences than ``minibatches`` give one each)."""
    parts = max(1, min(int(minibatches), count))
    return [index * count // parts for index in range(parts + 1)]


def plan_minibatches(
    lengths: Sequence[int],
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    minibatches: int = 1,
    sequences: Sequence[Sequence[int]] | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of a step taken in ``minibatches`` optimizer steps: the step's
    sequences in that many contiguous parts of their order (a rollout's: a GRPO group stays
    together, and no part gets only the longest sequences, as parts of a length-sorted plan would),
    each part planned on its own by :func:`plan_micro_batches` over the ranks, so every optimizer
    step has micro-batches of its own however many tokens one may hold. Micro-batches come in
    minibatch order, their ``indices`` into the whole step and :attr:`MicroBatch.minibatch` set;
    fewer sequences than ``minibatches`` give one step per sequence.

    Raises:
        ValueError: no sequences.
    """
    if not lengths:
        raise ValueError("plan_minibatches needs at least one sequence")
    bounds = minibatch_bounds(len(lengths), minibatches)
    planned = []
    for minibatch, (first, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        part = sequences[first:end] if sequences is not None else None
        for micro_batch in plan_micro_batches(lengths[first:end], dp_rank, dp_size, max_tokens, sequences=part):
            indices = [first + index for index in micro_batch.indices]
            planned.append(MicroBatch(indices, micro_batch.placeholder, minibatch))
    return planned


def plan_pair_micro_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    tree: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches of preference pairs (``pairs[i]``: the chosen and the rejected
    token ids): :func:`plan_micro_batches` over each pair's total length, so the two are never
    split. With ``tree`` a pair counts the tokens of its prefix tree (the prompt they share once)."""
    if tree:
        sizes = [tree_size([list(chosen), list(rejected)]) for chosen, rejected in pairs]
    else:
        sizes = [len(chosen) + len(rejected) for chosen, rejected in pairs]
    return plan_micro_batches(sizes, dp_rank, dp_size, max_tokens)
