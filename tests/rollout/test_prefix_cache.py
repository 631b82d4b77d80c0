"""The embedded engine's prefix cache: the trie's longest common prefix against a brute-force
search, and the pool's keys and values against the store rows they were copied from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rl2gem.rollout.engines.prefix_cache import PrefixCache, TokenTrie
from rl2gem.rollout.tito import common_prefix_length

LAYERS, HEADS, DIM = 3, 2, 4


def brute_longest(held: dict, query: list[int]) -> int:
    return max((common_prefix_length(tokens, query) for tokens in held.values()), default=0)


def test_the_trie_finds_the_longest_common_prefix_of_a_brute_force_search():
    """Random sequences over four tokens (so they share prefixes), inserted and removed at random:
    every lookup's length is the brute-force longest common prefix with the sequences held, and
    the handle returned holds a sequence that shares it."""
    rng = random.Random(0)
    trie, held = TokenTrie(), {}
    for step in range(3000):
        if held and rng.random() < 0.4:
            handle = rng.choice(list(held))
            trie.remove(handle)
            del held[handle]
        else:
            tokens = tuple(rng.randrange(4) for _ in range(rng.randrange(0, 12)))
            trie.insert(step, tokens)
            held[step] = tokens
        query = [rng.randrange(4) for _ in range(rng.randrange(0, 14))]
        length, handle = trie.longest(query)
        assert length == brute_longest(held, query)
        assert (handle is None) == (length == 0)
        if handle is not None:
            assert common_prefix_length(held[handle], query) == length
        assert len(trie) == len(held)
        assert trie.nodes() <= 2 * len(held) + 1  # a radix tree: a node per branch point, not per token
    with pytest.raises(KeyError):
        trie.insert(next(iter(held)), (1,))
    with pytest.raises(KeyError):
        trie.remove("absent")


def test_a_removed_sequence_leaves_the_ones_that_share_its_prefix():
    trie = TokenTrie()
    trie.insert("short", (1, 2))
    trie.insert("long", (1, 2, 3, 4))
    trie.remove("long")
    assert trie.longest([1, 2, 3, 4]) == (2, "short")
    trie.insert("long", (1, 2, 3, 4))
    trie.remove("short")
    assert trie.longest([1, 2, 9]) == (2, "long")  # a sequence through the node, ending below it
    trie.remove("long")
    assert trie.longest([1, 2]) == (0, None) and not trie._root.children
    for handle, tokens in (("a", (1, 2, 3)), ("b", (1, 2, 4)), ("c", (1, 5))):
        trie.insert(handle, tokens)
    trie.remove("b")  # (1, 2) is left with one child and no sequence ending there: merged
    assert trie.nodes() == 4 and trie.longest([1, 2, 3, 7]) == (3, "a") and trie.longest([1, 5]) == (2, "c")


def random_store(rows: int, columns: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, rows, HEADS, columns, DIM, generator=generator) for _ in range(LAYERS)]


def expected_kv(pairs: list[torch.Tensor], slot: int, columns: np.ndarray) -> list[torch.Tensor]:
    """Per layer ``[tokens, 2, heads, d]``: the row's keys and values, token by token."""
    return [torch.stack([pair[:, slot, :, int(column)] for column in columns]) for pair in pairs]


def read_all(cache: PrefixCache, positions: np.ndarray) -> list[torch.Tensor]:
    index = torch.from_numpy(positions)
    return [cache.read(layer, index) for layer in range(LAYERS)]


def test_kept_rows_read_back_as_the_store_held_them_through_evictions_and_growth():
    """Rows of random stores kept in random batches (holes in their columns, a budget that
    evicts, a pool that grows): after every batch, each sequence held reads back exactly the
    values it was copied from, and the sequences held are the most recent ones that fit."""
    rng = np.random.default_rng(1)
    cache = PrefixCache(300, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))
    truth, order = {}, []  # tokens -> per-layer values; least recently used first
    for batch in range(40):
        pairs = random_store(6, 40, seed=batch)
        rows = []
        for slot in rng.choice(6, size=rng.integers(1, 6), replace=False):
            length = int(rng.integers(2, 40))
            columns = np.sort(rng.choice(40, size=length, replace=False))
            tokens = tuple(int(t) for t in rng.integers(0, 50, length))
            rows.append((tokens, int(slot), columns))
            if tokens not in truth:
                truth[tokens] = expected_kv(pairs, int(slot), columns)
        cache.keep(pairs, rows)
        for tokens, _, _ in rows:
            order = [held for held in order if held != tokens] + [tokens]
        kept, total = [], 0
        for tokens in reversed(order):  # the newest that fit the budget
            if total + len(tokens) > 300:
                break
            kept.append(tokens)
            total += len(tokens)
        order = kept[::-1]
        assert list(cache._entries) == order and cache.size == total <= 300  # as if kept one at a time
        assert cache.capacity <= 300
        for tokens in rng.permutation(len(order)).tolist():  # used in a random order
            length, key = cache.lookup(list(order[tokens]) + [99])
            assert length == len(order[tokens]) and key == order[tokens]
            for got, want in zip(read_all(cache, cache.use(key, length)), truth[key], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            order = [held for held in order if held != key] + [key]
        assert list(cache._entries) == order  # each use made its sequence the most recent


def test_a_batch_keeps_its_newest_rows_and_skips_those_it_would_evict_at_once():
    cache = PrefixCache(10, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))
    pairs = random_store(4, 8, seed=0)
    columns = np.arange(4)
    cache.keep(pairs, [((1, 2, 3, 4), 0, columns)])
    cache.keep(pairs, [((5, 6, 7, 8), 1, columns), ((9, 9, 9, 9), 2, columns), ((7, 7, 7, 7), 3, columns)])
    assert list(cache._entries) == [(9, 9, 9, 9), (7, 7, 7, 7)] and cache.size == 8
    assert cache.capacity <= 10  # the first of the batch was never copied into a third of the pool
    long = tuple(range(11))
    cache.keep(random_store(1, 11, seed=1), [(long, 0, np.arange(11))])  # longer than the budget
    assert long not in cache and len(cache) == 2  # not kept, and it evicted nothing
    cache.keep(pairs, [((9, 9, 9, 9), 0, columns)])  # held: the most recent now, not copied again
    assert list(cache._entries)[-1] == (9, 9, 9, 9)
    cache.keep(pairs, [((4, 4, 4, 4), 1, columns)])
    assert list(cache._entries) == [(9, 9, 9, 9), (4, 4, 4, 4)]
    cache.keep(pairs, [((3, 3, 3, 3), 1, columns), ((2, 2, 2, 2), 2, columns), ((3, 3, 3, 3), 1, columns)])
    assert list(cache._entries) == [(2, 2, 2, 2), (3, 3, 3, 3)]  # a batch's repeated row counts where it comes last
    cache.keep(pairs, [((1, 1), 0, columns[:2])])
    # six and five tokens overflow the budget: the five stay, and everything before them goes,
    # the held (3, 3, 3, 3) kept in the middle of the batch included, as one row at a time would
    cache.keep(pairs, [((3, 3, 3, 3), 1, columns), ((6,) * 6, 0, np.arange(6)), ((5,) * 5, 1, np.arange(5))])
    assert list(cache._entries) == [(5,) * 5] and cache.size == 5


def test_clear_keeps_the_pool_and_release_frees_it():
    cache = PrefixCache(64, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.keep(random_store(1, 8, seed=0), [((1,) * 8, 0, np.arange(8))])
    allocated = cache.capacity
    cache.clear()
    assert cache.lookup([1] * 9) == (0, None) and cache.size == 0 and cache.capacity == allocated > 0
    cache.keep(random_store(1, 8, seed=0), [((2,) * 8, 0, np.arange(8))])
    assert cache.capacity == allocated and cache.lookup([2] * 3)[0] == 3
    cache.release()
    assert cache.capacity == 0 and cache.nbytes == 0 and len(cache) == 0
    disabled = PrefixCache(0, LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"))
    disabled.keep(random_store(1, 8, seed=0), [((1,) * 8, 0, np.arange(8))])
    assert len(disabled) == 0 and disabled.capacity == 0
