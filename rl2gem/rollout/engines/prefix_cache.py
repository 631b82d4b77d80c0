"""The embedded engine's prefix cache: finished sequences' keys and values, found by the longest
common prefix of a new prompt.

A request that extends a finished one (the next turn of an episode, a partial rollout resuming,
a GRPO group's later request) prefills only the tokens after the longest prefix it shares with
any cached sequence, since a causal model's keys and values at a position depend only on the
tokens up to it.

- :class:`TokenTrie` finds that prefix: a radix tree over token ids, so a lookup walks the
  query once (``O(prefix length)``) instead of comparing it with every cached sequence.
- :class:`PrefixCache` keeps the keys and values in one token pool per layer (SGLang's
  ``token_to_kv_pool`` with pages of one token): a cached sequence owns a list of pool positions,
  so keeping the sequences of a whole decode wave is one gather and one scatter per layer (on a
  GPU, one copy per layer and row was a kernel launch each, every one of them host time the
  device waits for), and evicting one frees its positions without coupling it to the others
  kept with it. Least recently used sequences go first when the token budget is exceeded.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from rl2gem.devices import to_device

__all__ = ["PrefixCache", "TokenTrie"]


class _Node:
    __slots__ = ("label", "children", "count", "ends")

    def __init__(self, label: tuple[int, ...]):
        self.label = label  # the tokens from the parent to this node
        self.children: dict[int, _Node] = {}  # by the first token of their label
        self.count = 0  # sequences through this node: ending here or below
        self.ends: dict[Hashable, None] = {}  # the sequences that end here (an ordered set)


def _shared(label: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``label`` and ``tokens[start:]``."""
    if tokens[start : start + len(label)] == label:  # the usual case, compared in C
        return len(label)
    count, limit = 0, min(len(label), len(tokens) - start)
    while count < limit and label[count] == tokens[start + count]:
        count += 1
    return count


class TokenTrie:
    """Token sequences under handles, searched by the longest common prefix with a query.

    A radix tree: a node per branch point, each edge labelled with a run of tokens, so a batch of
    sequences adds a few Python objects each rather than one per token (a trie of a node per token
    made the garbage collector's full passes over the process run at every decode wave: 150 ms of
    every 170 ms of a wave's end, measured on the CPU). Insertion, removal and lookup walk the
    sequence once; sequences that share a prefix share its nodes.
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._root = _Node(())
        self._tokens: dict[Hashable, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, handle: Hashable) -> bool:
        return handle in self._tokens

    def insert(self, handle: Hashable, tokens: Sequence[int]) -> None:
        """Add ``tokens`` under ``handle`` (hashable, not already present).

        Raises:
            KeyError: ``handle`` is already present.
        """
        if handle in self._tokens:
            raise KeyError(f"{handle!r} is already in the trie")
        tokens = tuple(tokens)
        self._tokens[handle] = tokens
        node, position = self._root, 0
        node.count += 1
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                child = node.children[tokens[position]] = _Node(tokens[position:])
            else:
                shared = _shared(child.label, tokens, position)
                if shared < len(child.label):  # split the edge where the sequences part
                    middle = _Node(child.label[:shared])
                    middle.count = child.count
                    child.label = child.label[shared:]
                    middle.children[child.label[0]] = child
                    node.children[tokens[position]] = child = middle
            child.count += 1
            node, position = child, position + len(child.label)
        node.ends[handle] = None

    def remove(self, handle: Hashable) -> None:
        """Drop the sequence under ``handle`` (nodes no other sequence passes through go with it,
        and a node left with one child and no sequence ending at it merges with that child).

        Raises:
            KeyError: ``handle`` is not present.
        """
        tokens = self._tokens.pop(handle)
        path, node, position = [], self._root, 0
        while position < len(tokens):
            child = node.children[tokens[position]]
            path.append((node, child))
            node, position = child, position + len(child.label)
        del node.ends[handle]
        self._root.count -= 1
        deepest = self._root  # the deepest node that stays
        for parent, child in path:
            child.count -= 1
            if child.count == 0:
                del parent.children[child.label[0]]  # the rest of the path held only this sequence
                break
            deepest = child
        if deepest is not self._root and not deepest.ends and len(deepest.children) == 1:
            (only,) = deepest.children.values()
            deepest.label += only.label
            deepest.children, deepest.ends = only.children, only.ends

    def longest(self, query: Sequence[int]) -> tuple[int, Hashable | None]:
        """-> ``(length, handle)``: the longest common prefix of ``query`` with any sequence held,
        and the handle of one sequence that shares it (those ending at that prefix first);
        ``(0, None)`` when none shares a first token."""
        query = tuple(query)
        node, length = self._root, 0
        while length < len(query):
            child = node.children.get(query[length])
            if child is None:
                break
            shared = _shared(child.label, query, length)
            node, length = child, length + shared
            if shared < len(child.label):
                break
        if length == 0:
            return 0, None
        while not node.ends:  # a node with a count has a sequence ending at it or below
            node = next(iter(node.children.values()))
        return length, next(iter(node.ends))

    def nodes(self) -> int:
        """Nodes in the tree, the root included."""
        count, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


class PrefixCache:
    """Token sequences' keys and values in a pool of token positions, least recently used first out.

    Args:
        budget: most tokens held (the pool never grows past it); 0 keeps nothing.
        num_layers, kv_heads, head_dim, dtype, device: the model's KV layout; the pool is, per
            layer, ``[capacity, 2, kv_heads, head_dim]`` (a token's keys, then its values) of
            ``dtype`` on ``device``, allocated as sequences arrive (doubling, up to ``budget``;
            after :meth:`release`, at once to the capacity it had).
    """

    def __init__(self, budget: int, num_layers: int, kv_heads: int, head_dim: int, dtype, device):
        self.budget = int(budget)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._entries: collections.OrderedDict[tuple[int, ...], np.ndarray] = collections.OrderedDict()
        self._trie = TokenTrie()
        self.size = 0  # tokens held
        self.allocations = 0  # times the pool was allocated or grown
        self._released_capacity = 0  # the pool's capacity when last freed: where it grows back to at once
        self.pool: list[torch.Tensor] = []
        self.release()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._entries

    @property
    def capacity(self) -> int:
        """Token positions allocated in the pool."""
        return self.pool[0].shape[0] if self.pool else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.pool)

    def clear(self) -> None:
        """Drop every sequence; the pool stays allocated."""
        self._entries.clear()
        self._trie.clear()
        self.size = 0
        self._free = np.arange(self.capacity, dtype=np.int64)

    def release(self) -> None:
        """Drop every sequence and free the pool; its next allocation takes the capacity it had
        at once (a trainer's next rollout needs about what the last one did), not by doublings
        that each copy the pool."""
        if self.pool:
            self._released_capacity = self.capacity
        self.pool = []
        self.clear()

    def lookup(self, query: Sequence[int]) -> tuple[int, tuple[int, ...] | None]:
        """-> ``(length, sequence)``: the longest prefix of ``query`` that a held sequence shares
        and that sequence (its key for :meth:`use`), or ``(0, None)``. Nothing is refreshed: a
        caller that discards the match (too short, a better one elsewhere) leaves the order."""
        length, tokens = self._trie.longest(query)
        return (length, tokens) if tokens is not None else (0, None)

    def use(self, tokens: tuple[int, ...], length: int) -> np.ndarray:
        """The pool positions of the first ``length`` tokens of the held sequence ``tokens``
        (int64, host), which becomes the most recently used. They stay valid until the next
        :meth:`keep`, :meth:`clear` or :meth:`release`."""
        self._entries.move_to_end(tokens)
        return self._entries[tokens][:length]

    def read(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s keys and values at ``positions`` (int64 ``[n]`` on the pool's device)
        -> ``[n, 2, kv_heads, head_dim]``, a new tensor."""
        return self.pool[layer][positions]

    def keep(self, pairs: Sequence[torch.Tensor], rows: Sequence[tuple[tuple[int, ...], int, np.ndarray]]) -> None:
        """Keep rows of a KV store, in order: afterwards the rows' sequences are the most recently
        used, the last row's most, as if kept one at a time.

        Args:
            pairs: the store's buffers, per layer ``[2, slots, kv_heads, columns, head_dim]`` on the
                pool's device and dtype.
            rows: ``(tokens, slot, columns)``: the row ``slot`` holds ``tokens``' keys and values
                in ``columns`` (int64 ``[len(tokens)]``, host). A sequence already held is not
                copied again; one longer than the budget is not kept (nor does it evict others);
                rows that later ones would evict at once are not copied.
        """
        if self.budget <= 0:
            return
        batch: dict[tuple[int, ...], tuple[int, np.ndarray] | None] = {}  # None: held already
        for tokens, slot, columns in rows:
            if len(tokens) <= self.budget:
                batch.pop(tokens, None)  # where it comes last counts
                batch[tokens] = None if tokens in self._entries else (slot, columns)
        kept, total = [], 0
        for tokens in reversed(batch):  # the newest that fit the budget together
            if total + len(tokens) > self.budget:
                break
            kept.append(tokens)
            total += len(tokens)
        kept.reverse()
        if len(kept) < len(batch):  # the batch alone fills the budget: everything older goes
            keeping = set(kept)
            for tokens in [held for held in self._entries if held not in keeping]:
                self._evict(tokens)
        for tokens in kept:  # held ones behind every sequence the batch leaves out
            if batch[tokens] is None:
                self._entries.move_to_end(tokens)
        chosen = [tokens for tokens in kept if batch[tokens] is not None]
        if chosen:
            self._copy(pairs, chosen, [batch[tokens] for tokens in chosen])
        for tokens in kept:  # the batch's order
            self._entries.move_to_end(tokens)

    def _copy(self, pairs: Sequence[torch.Tensor], chosen: list[tuple[int, ...]], rows: list) -> None:
        """Copy the store rows ``rows`` (``(slot, columns)``) of the new sequences ``chosen`` into
        the pool, after evicting the least recently used sequences they need room from: one
        host-to-device copy of the indexes, one gather and one scatter per layer."""
        lengths = [len(tokens) for tokens in chosen]
        total = sum(lengths)
        while self.size + total > self.budget:
            self._evict(next(iter(self._entries)))
        positions = self._allocate(total)
        index = np.empty((3, total), dtype=np.int64)  # pool positions, store rows, store columns
        index[0] = positions
        index[1] = np.repeat([slot for slot, _ in rows], lengths)
        index[2] = np.concatenate([columns for _, columns in rows])
        on_device = to_device(torch.from_numpy(index), self.device)  # not waiting for a launched round
        for layer, pair in enumerate(pairs):  # the two index tensors apart: [tokens, 2, kv_heads, d]
            self.pool[layer][on_device[0]] = pair[:, on_device[1], :, on_device[2]]
        start = 0
        for tokens, length in zip(chosen, lengths, strict=True):
            self._entries[tokens] = positions[start : start + length]
            self._trie.insert(tokens, tokens)
            start += length
        self.size += total

    def _evict(self, tokens: tuple[int, ...]) -> None:
        positions = self._entries.pop(tokens)
        self._trie.remove(tokens)
        self._free = np.concatenate([self._free, positions])
        self.size -= len(tokens)

    def _allocate(self, count: int) -> np.ndarray:
        """``count`` free positions (the pool grows when it has too few)."""
        if len(self._free) < count:
            old = self.capacity
            new = min(self.budget, max(2 * old, old + count - len(self._free), 256, self._released_capacity))
            self._released_capacity = 0
            self.allocations += 1
            shape = (2, self.kv_heads, self.head_dim)
            for layer in range(self.num_layers):  # layer by layer: each old one is freed before the next
                grown = torch.empty((new, *shape), dtype=self.dtype, device=self.device)
                if old:
                    grown[:old] = self.pool[layer]
                if layer < len(self.pool):
                    self.pool[layer] = grown
                else:
                    self.pool.append(grown)
            self._free = np.concatenate([self._free, np.arange(old, new, dtype=np.int64)])
        positions = self._free[len(self._free) - count :].copy()
        self._free = self._free[: len(self._free) - count]
        return positions
