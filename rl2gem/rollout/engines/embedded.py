"""In-process engine: a transformers causal LM with continuous batching.

Requests from any number of coroutines share one decode loop that runs in a
worker thread (torch releases the GIL, so the event loop and the envs keep
running while the model computes). Every iteration the scheduler

1. admits queued requests (bounded by ``max_batch_size`` sequences and
   ``max_prefill_tokens`` / ``max_cached_tokens`` tokens) and prefills them
   together, sampling their first token;
2. runs ONE decode step for every running sequence, whatever its length;
3. retires finished sequences at once, so a short answer frees its slot for a
   queued request instead of idling until the longest one ends (the waste of
   static batching in ``model.generate``).

The KV cache is owned by the engine: per layer one buffer
``[2, slots, kv_heads, columns, head_dim]`` (the keys, then the values: one kernel writes or
copies both) where all running sequences share a
column window ``[lo, hi)`` and each sequence occupies the right end of it
(left padding, masked). A finished sequence's slot is filled by moving the
last slot into it (one row copy), so no compute is spent on dead rows; the
window grows to the right with amortised re-allocation and shrinks from the
left for free when long sequences leave. transformers' own continuous-batching
API (``generate_batch``) was measured at 21 tok/s against 47 tok/s for static
``model.generate`` on the 2-core CPU (transformers 5.x, November 2026), which is why this
engine keeps its own scheduler.

Llama-family models (Llama, Mistral without a sliding window, Qwen2, Qwen3) run through
:class:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder`: the same modules without
transformers' per-step mask building, prefill packed without padding, attention per chunk of
rows over only the columns that chunk needs, the LM head in slices. Others (or ``lean=False``)
call ``model(...)`` with a cache object over the same store. The engine thread frees its
OpenMP team when it goes idle and the requesting thread's team is freed when a request arrives,
so that two teams never compete for the cores (:mod:`rl2gem.openmp`).

Log-probabilities are those of ``log_softmax(logits / T)`` (see
:class:`~rl2gem.rollout.engines.base.GenerateOutput`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl2gem.devices import indexes_to_device, to_device
from rl2gem.openmp import release_thread_team
from rl2gem.rollout.engines.base import Engine, EngineError, GenerateOutput, SamplingParams
from rl2gem.rollout.engines.cuda_graphs import DecodeGraphs
from rl2gem.rollout.engines.lean_decoder import LeanDecoder, unsupported_reason
from rl2gem.rollout.engines.prefix_cache import PrefixCache, TokenTrie
from rl2gem.rollout.engines.sampling import draw_uniforms, filtered, row_settings, sample
from rl2gem.rollout.tito import common_prefix_length

__all__ = ["EmbeddedEngine"]


# --------------------------------------------------------------------------- KV store
class _KVStore:
    """Engine-owned KV cache of the running batch (see module docstring).

    A released store remembers the most rows and columns it needed (``sizes``) and allocates them,
    plus a quarter of the columns, at once when it is used again: a trainer frees the store after
    every rollout, and a multi-turn rollout whose window grows turn by turn would otherwise
    re-allocate (copy every layer, and drop the captured decode graphs) several times in each."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, max_slots: int | None = None):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_slots = max_slots  # rows never exceed it (the engine's max_batch_size)
        self.dtype, self.device = dtype, device
        # called before the buffers are freed or replaced: what holds views of them (the decode
        # graphs) drops them, so the old buffers are freed before the new ones are allocated
        self.on_reallocate: Callable[[], None] | None = None
        self.on_allocate: Callable[[], None] | None = None  # called at each allocation (a counter)
        self.sizes = (0, 0)  # the most (rows, columns) needed before the last release
        self._needed = (0, 0)  # the same since the last release
        self.release()

    def release(self, keep: bool = False) -> None:
        """Empty the store and free its buffers (the next :meth:`reserve` allocates again, at
        least the rows and columns needed since the previous release: ``sizes``); ``keep``: the
        buffers stay allocated (what reads them, the decode graphs, stays valid)."""
        if any(self._needed):
            self.sizes, self._needed = self._needed, (0, 0)
        if keep and self.pairs:
            self.clear()
            return
        if self.on_reallocate is not None:
            self.on_reallocate()
        # per layer [2, slots, kv_heads, columns, head_dim]: keys[i] and values[i] are its halves
        self.pairs: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.slots = 0  # rows in use
        self.lo = self.hi = 0

    @property
    def capacity(self) -> tuple[int, int]:
        return (self.mask.shape[0], self.mask.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated now."""
        return sum(t.nbytes for t in (*self.pairs, self.mask))

    @property
    def window(self) -> int:
        return self.hi - self.lo

    def fits(self, slots: int, left: int, right: int, growth: int = 0) -> bool:
        """Whether :meth:`reserve` with these arguments keeps the buffers (at most slides the
        window inside them): no re-allocation, so what reads them stays valid."""
        cap_s, cap_c = self.capacity
        in_place = self.lo >= left and cap_c - self.hi >= right
        return slots <= cap_s and (in_place or left + self.window + max(right, growth) <= cap_c)

    def reserve(self, slots: int, left: int, right: int, growth: int = 0, expect: int = 0) -> None:
        """Make room for ``slots`` rows, ``left`` columns before ``lo`` and ``right`` after ``hi``.

        ``expect``: rows likely needed soon (queued requests); when the rows grow they grow to
        at least that many at once, so a queue admitted in several waves copies the store once.
        ``growth``: columns the running rows may still add (their longest remaining budget). When
        the buffers can hold ``left + window + max(right, growth)`` columns the window slides
        inside them (one copy of the window, no allocation); otherwise they are re-allocated with
        1.5 times that, so a decode wave slides but seldom re-allocates (fresh memory costs page
        faults: about 1 s per GB on the 2-core machine); rows grow by doubling up to ``max_slots``.
        Columns outside the window keep stale finite values: the mask excludes them.
        """
        cap_s, cap_c = self.capacity
        w = self.window
        want_right = max(right, growth)
        need = left + w + want_right
        self._needed = (max(self._needed[0], slots), max(self._needed[1], need))
        if slots <= cap_s and self.lo >= left and cap_c - self.hi >= right:
            return
        margin = max(w // 4, 64)
        if slots <= cap_s and need <= cap_c:
            lo = max(left, min(margin, cap_c - w - want_right))
            n = self.slots
            for pair in self.pairs:
                pair[:, :n, :, lo : lo + w] = pair[:, :n, :, self.lo : self.hi].clone()
            window = self.mask[:n, self.lo : self.hi].clone()
            self.mask[:n] = False
            self.mask[:n, lo : lo + w] = window
            self.lo, self.hi = lo, lo + w
            return
        new_s = cap_s
        if slots > cap_s:
            new_s = max(slots, 2 * cap_s, 4, expect, self.sizes[0])
            if self.max_slots:
                if slots > self.max_slots:
                    raise ValueError(f"{slots} rows exceed the store's {self.max_slots}")
                new_s = min(new_s, self.max_slots)
        new_c = max(need + need // 2, cap_c, self.sizes[1] + self.sizes[1] // 4) if need > cap_c else cap_c
        lo = max(left, min(margin, new_c - w - want_right))
        if self.on_reallocate is not None:
            self.on_reallocate()
        if not self.pairs:
            self.pairs = [None] * self.num_layers
        self.keys, self.values = [], []  # their views would keep every old layer allocated
        for i in range(self.num_layers):  # layer by layer: the old layer is freed before the next is allocated
            shape = (2, new_s, self.kv_heads, new_c, self.head_dim)
            pair, old = torch.zeros(shape, dtype=self.dtype, device=self.device), self.pairs[i]
            if old is not None and self.slots and w:
                pair[:, : self.slots, :, lo : lo + w] = old[:, : self.slots, :, self.lo : self.hi]
            self.pairs[i] = pair
            del old, pair  # nothing holds the old layer now: it is freed before the next is allocated
        self.keys, self.values = [pair[0] for pair in self.pairs], [pair[1] for pair in self.pairs]
        mask = torch.zeros(new_s, new_c, dtype=torch.bool, device=self.device)
        if self.slots and w:
            mask[: self.slots, lo : lo + w] = self.mask[: self.slots, self.lo : self.hi]
        self.mask = mask
        self.lo, self.hi = lo, lo + w
        if self.on_allocate is not None:
            self.on_allocate()

    def move(self, sources: list[int], destinations: list[int]) -> None:
        """Copy the window of rows ``sources`` into rows ``destinations`` (disjoint): one indexed
        copy per layer and one of the mask, whatever the number of rows."""
        lo, hi = self.lo, self.hi
        index = to_device(torch.tensor([sources, destinations]), self.mask.device)
        for pair in self.pairs:
            pair[:, index[1], :, lo:hi] = pair[:, index[0], :, lo:hi]
        self.mask[index[1]] = self.mask[index[0]]

    def clear(self) -> None:
        self.slots = 0
        self.lo = self.hi = self.capacity[1] // 2


_STEP_CACHE_CLASS = None


def _step_cache(store: _KVStore):
    """A transformers ``Cache`` whose layers read and write :class:`_KVStore` for one decode step."""
    global _STEP_CACHE_CLASS
    if _STEP_CACHE_CLASS is None:
        from transformers.cache_utils import Cache, CacheLayerMixin

        class _StepLayer(CacheLayerMixin):
            is_sliding = False
            is_compileable = False

            def __init__(self, store: _KVStore, idx: int):
                super().__init__()
                self.store, self.idx = store, idx
                self.is_initialized = True

            def lazy_initialization(self, key_states, value_states):  # storage is pre-allocated
                pass

            def update(self, key_states, value_states, *args, **kwargs):
                s = self.store
                n, q = s.slots, key_states.shape[2]
                s.keys[self.idx][:n, :, s.hi : s.hi + q] = key_states
                s.values[self.idx][:n, :, s.hi : s.hi + q] = value_states
                return s.keys[self.idx][:n, :, s.lo : s.hi + q], s.values[self.idx][:n, :, s.lo : s.hi + q]

            def get_seq_length(self) -> int:
                return self.store.window

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.store.window + query_length, 0

            def get_max_length(self) -> int:
                return -1

        class _StepCache(Cache):
            def __init__(self, store):
                super().__init__(layers=[_StepLayer(store, i) for i in range(store.num_layers)])

        _STEP_CACHE_CLASS = _StepCache
    return _STEP_CACHE_CLASS(store)


# --------------------------------------------------------------------------- requests
class _Request:
    __slots__ = (
        "rid",
        "input_ids",
        "params",
        "logprob_start_len",
        "loop",
        "future",
        "out_ids",
        "out_lp",
        "length",
        "span",
        "stop_ids",
        "input_lp",
        "t_submit",
        "version",
        "cached",
        "on_token",
        "overrun",
    )

    def __init__(self, rid, input_ids, params, logprob_start_len, loop, future, stop_ids):
        self.rid, self.input_ids, self.params = rid, input_ids, params
        self.logprob_start_len = logprob_start_len
        self.loop, self.future, self.stop_ids = loop, future, stop_ids
        self.out_ids: list[int] = []
        self.out_lp: list[float] = []
        self.length = 0  # tokens in the KV cache (= position of the next token)
        self.span = 0  # columns from its first cached token to the window's end (>= length: masked holes)
        self.cached = 0  # prompt tokens served from the prefix cache
        self.input_lp = None
        self.t_submit = time.perf_counter()
        self.version = 0
        self.on_token = None  # called on the requester's loop with a round's [(token, logprob), ...]
        self.overrun = 0  # columns after its stop that a chunk of decode steps wrote (masked out)


class _FirstTokens:
    """The first tokens ``[n]`` int64 and log-probabilities ``[n]`` float32 that a prefill behind
    a queued decode round sampled for ``requests``: kept on the device, where the round launched
    next reads them as those rows' input tokens, and copied to pinned host memory without
    waiting; :meth:`read` waits for that copy only, not for a round queued after it."""

    def __init__(self, requests: list[_Request], tokens: torch.Tensor, logprobs: torch.Tensor):
        self.requests, self.tokens = requests, tokens
        self.place = {id(request): index for index, request in enumerate(requests)}
        cuda = tokens.device.type == "cuda"
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in (tokens, logprobs))
        for host, device in zip(self._host, (tokens, logprobs), strict=True):
            host.copy_(device, non_blocking=cuda)
        self._done = torch.cuda.Event() if cuda else None
        if self._done is not None:
            self._done.record()

    def read(self) -> tuple[list[int], list[float]]:
        if self._done is not None:
            self._done.synchronize()
        return self._host[0].tolist(), self._host[1].tolist()


# --------------------------------------------------------------------------- engine
class EmbeddedEngine(Engine):
    """Continuous-batching transformers engine in this process (see module docstring).

    Args:
        model: a transformers causal LM (decoder-only, standard KV cache), or a
            name/path for :func:`rl2gem.models.load_model`.
        tokenizer: only used for the EOS id when the model config lacks one.
        max_batch_size: most sequences decoded together.
        max_prefill_tokens: most prompt tokens prefilled in one forward.
        max_cached_tokens: bound on ``running sequences x window`` (KV memory:
            SmolLM2-135M uses 46 KB per cached token in fp32).
        context_length: longest sequence (prompt + output); defaults to the
            model's ``max_position_embeddings``.
        seed: seed of the sampling generator.
        prefix_cache_tokens: tokens of finished requests' KV kept (LRU) so a request that extends
            one (the next turn of an episode, a resumed partial rollout) prefills only its new
            tokens; 0 disables it. It also holds the prefixes that prompts admitted together share
            (a system prompt), prefilled once before them. The KV lives in a pool of at most this
            many tokens (:class:`~rl2gem.rollout.engines.prefix_cache.PrefixCache`), allocated as
            it fills; :meth:`flush_cache` empties it, weight updates and :meth:`release_memory`
            free it.
        lean: run prefill and decode through :class:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder`
            (packed prefill without padding, row-chunked attention, sliced LM head) when the
            model is Llama-family; ``False``, or another architecture, calls ``model(...)`` with
            a cache over the same store (``lean_reason`` says why the lean path is off).
        decode_graphs: run decode steps through captured CUDA graphs
            (:class:`~rl2gem.rollout.engines.cuda_graphs.DecodeGraphs`); ``None`` (the default)
            turns them on for a model on CUDA that takes the lean path. ``True`` off CUDA runs the
            same fixed-shape step eagerly (a test of it on the CPU).
        decode_steps: with decode graphs, decode steps run per host round trip: each step samples
            on the device and feeds the next, the host reads the tokens once per ``decode_steps``
            and drops those after a row stopped (a stop token costs up to ``decode_steps - 1``
            wasted steps of that row; a length limit costs none). ``None``: 4 with graphs on CUDA,
            else 1. Rows with top-k or top-p run one step at a time, sampled on the host side.
        decode_compile: with decode graphs, ``torch.compile`` the captured step first (fused
            kernels: fewer launches in each graph; compiled once, with dynamic shapes, at the first
            capture): ``True`` (Inductor) or a ``torch.compile`` backend (a name or a callable);
            ``False`` (the default until a GPU run has measured it against the uncompiled graphs:
            ``benchmarks/gpu.py``'s decode table). A step that fails to compile turns the
            compilation off (a warning, ``stats["decode_compile_failed"]``), not the graphs.
        decode_overlap: with decode graphs, queue each round of sampled steps on the device
            before the last round's tokens are read, its input tokens taken from that round's
            outputs there (SGLang's overlap scheduling): the device runs it while the host reads
            the last round, hands its tokens out, finishes its stopped rows and stages the next,
            so the device need not wait for the host between rounds. Requests that arrive
            meanwhile are prefilled behind the queued round where they join the KV store without
            re-allocating it and read nothing on the host before their first tokens (no top-k,
            top-p or prompt log-probs), else after it; they join the round after the queued one
            (one round later than without overlap), which takes their first tokens from their
            prefill on the device. A row that stopped runs the queued round too, dropped; no round
            is queued past every row's token budget, but one is after a round in which every row
            met a stop token. Greedy and seeded tokens are the same as without it; unseeded ones
            differ (the dropped rows draw uniforms too). ``False`` (the default until a GPU run
            has measured it: ``benchmarks/gpu.py``'s decode table).
        kept_kv_bytes: :meth:`release_memory` and weight updates keep the KV stores allocated
            (emptied) while they hold at most this many bytes together, and with them the
            captured decode graphs, which a trainer's next rollout would otherwise capture again,
            and the prefix cache's pool if it fits too; larger stores are freed. ``None``: 5% of
            the device's memory on CUDA (the update's ``actor.memory_fraction`` leaves more than
            that free), 0 elsewhere.

    Attributes:
        stats: counters since the engine started (a ``collections.Counter``): ``requests``,
            ``finished``, ``prefill_forwards``, ``prefill_tokens``, ``cached_tokens``,
            ``decode_steps``, ``decode_rounds`` (host round trips), ``decode_rounds_ahead`` (of
            them, queued before the last round's tokens were read: ``decode_overlap``),
            ``admissions_behind`` (prefills queued behind such a round),
            ``decode_tokens`` (rows x steps, dropped tokens included), ``decode_graph_captures``,
            ``decode_graphs_failed``, ``kv_allocations`` and ``prefill_kv_allocations`` (the KV
            stores' buffer allocations), and times in ms (floats, summed unrounded: a decode round
            can take under a millisecond):
            ``time_admit_ms`` (prefills), ``time_decode_ms``, of it ``time_decode_forward_ms``
            (the steps: staging, launch, waiting for their tokens) and ``time_decode_handout_ms``
            (the tokens handed to their requests, stopped rows finished), ``time_capture_ms``
            (graph warm-ups and captures).
            PPO logs them per step under ``engine/`` (:class:`rl2gem.training.online.OnlineTrainer`).

    Raises:
        ValueError: ``decode_graphs=True`` for a model the lean path cannot run;
            ``decode_compile`` or ``decode_overlap`` without decode graphs.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        max_cached_tokens: int = 1 << 17,
        context_length: int | None = None,
        seed: int = 0,
        dtype=None,
        prefix_cache_tokens: int = 1 << 15,
        lean: bool = True,
        decode_graphs: bool | None = None,
        decode_steps: int | None = None,
        decode_compile: bool | str | Callable = False,
        decode_overlap: bool = False,
        kept_kv_bytes: int | None = None,
    ):
        if isinstance(model, (str, Path)):
            from rl2gem.models import load_model

            model, tokenizer = load_model(str(model), dtype=dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(context_length or getattr(cfg, "max_position_embeddings", 4096))
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.lean_reason = unsupported_reason(model, self.context_length) if lean else "lean=False"
        p = next(model.parameters())
        # on CUDA the LM head is one matmul (its slices save host memory on the CPU)
        vocab_chunk = self.vocab_size if p.device.type == "cuda" else 2048
        self._lean = None
        if self.lean_reason is None:
            self._lean = LeanDecoder(model, vocab_chunk=vocab_chunk, max_positions=self.context_length)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.max_batch_size = int(max_batch_size)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.max_cached_tokens = int(max_cached_tokens)
        self.prefix_cache_tokens = int(prefix_cache_tokens)
        self.min_prefix_match = 8  # shorter shared prefixes are not worth the copy
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        layout = (cfg.num_hidden_layers, kv_heads, head_dim, p.dtype, p.device)
        self._prefix_cache = PrefixCache(self.prefix_cache_tokens, *layout)
        self._running_prompts = TokenTrie()  # the running rows' prompts, under their requests
        self._store = _KVStore(cfg.num_hidden_layers, kv_heads, head_dim, p.dtype, p.device, int(max_batch_size))
        self._prefill_store = _KVStore(cfg.num_hidden_layers, kv_heads, head_dim, p.dtype, p.device)
        self._device = p.device
        if decode_graphs is None:
            decode_graphs = self._lean is not None and p.device.type == "cuda"
        if decode_graphs and self._lean is None:
            raise ValueError(
                f"decode_graphs=True needs the lean decoder, which cannot run this model: {self.lean_reason}"
            )
        if decode_compile and not decode_graphs:
            raise ValueError("decode_compile needs decode_graphs (the compiled step is the captured one)")
        backend = ("inductor" if decode_compile is True else decode_compile) if decode_compile else None
        self._graphs = (
            DecodeGraphs(self._lean, capture=p.device.type == "cuda", compile_backend=backend)
            if decode_graphs
            else None
        )
        if self._graphs is not None:
            self._store.on_reallocate = self._graphs.reset  # the graphs read the store's buffers
        if decode_steps is None:
            decode_steps = 4 if decode_graphs and p.device.type == "cuda" else 1
        if int(decode_steps) < 1:
            raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
        self.decode_steps = int(decode_steps)
        if decode_overlap and not decode_graphs:
            raise ValueError("decode_overlap needs decode_graphs (it launches the sampled steps ahead)")
        self.decode_overlap = bool(decode_overlap)
        if kept_kv_bytes is None:
            cuda = p.device.type == "cuda"
            kept_kv_bytes = torch.cuda.get_device_properties(p.device).total_memory // 20 if cuda else 0
        self.kept_kv_bytes = int(kept_kv_bytes)
        self._gen = torch.Generator().manual_seed(seed)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._admitting: list[_Request] = []  # taken from the queue, being prefilled
        # the first tokens of rows prefilled behind a queued round, not handed out yet: on the
        # device (the next round reads them there) and on their way to pinned host memory
        self._deferred: _FirstTokens | None = None
        self._commands: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._paused = False
        self._closed = False
        self.weight_version = 0
        self.stats = collections.Counter()
        self._store.on_allocate = lambda: self.stats.update(kv_allocations=1)
        self._prefill_store.on_allocate = lambda: self.stats.update(prefill_kv_allocations=1)
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="rl2gem-embedded-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(self, input_ids, sampling_params=None, *, return_logprob=True, logprob_start_len=-1, rid=None):
        return await self._submit(input_ids, sampling_params, logprob_start_len, rid, None)

    async def generate_stream(self, input_ids, sampling_params=None, *, rid=None):
        """Yields ``(token_id, logprob)`` as tokens are sampled, then the :class:`GenerateOutput`
        (see :meth:`Engine.generate_stream`): a round's tokens (``decode_steps`` on the device)
        reach the requester's event loop together, one wake-up per round for every stream on it."""
        queue: asyncio.Queue = asyncio.Queue()  # each round's tokens of the request as one list
        task = asyncio.ensure_future(self._submit(input_ids, sampling_params, -1, rid, queue.put_nowait))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (items := await queue.get()) is not None:
                for item in items:
                    yield item
            yield task.result()
        finally:
            if not task.done():  # the consumer stopped early: the request is cancelled (and aborted)
                task.cancel()

    async def _submit(self, input_ids, sampling_params, logprob_start_len, rid, on_token):
        params = SamplingParams.from_dict(sampling_params)
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context length {self.context_length}")
        if self._closed:
            raise EngineError("engine is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        req = _Request(
            rid or f"r{next(self._ids)}-{uuid.uuid4().hex[:6]}", ids, params, int(logprob_start_len), loop, fut, stop
        )
        req.on_token = on_token
        release_thread_team()  # this thread's idle OpenMP team would slow the engine's (rl2gem.openmp)
        with self._cv:
            self._waiting.append(req)
            self.stats["requests"] += 1
            self._cv.notify()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._command(lambda: self._abort_rid(req.rid, "cancelled"), wait=False)
            raise

    async def pause(self, mode: str = "abort") -> None:
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")

        def do():
            self._paused = True
            if mode == "abort":
                self._abort_running(self._running, "paused")
                self._store.clear()

        await self._acommand(do)

    async def resume(self) -> None:
        def do():
            self._paused = False

        await self._acommand(do)

    async def abort(self, rid: str | None = None) -> None:
        await self._acommand(lambda: self._abort_rid(rid, "aborted"))

    async def update_weights(self, weights, version: int | None = None) -> int:
        if isinstance(weights, (str, Path)):
            weights = _load_folder(Path(weights))
        items = list(weights.items() if isinstance(weights, Mapping) else weights)

        def do():
            self._abort_running(self._running, "weight update")
            self._release_memory(keep_small=True)
            params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
            unknown = [n for n, _ in items if n not in params]
            if unknown:
                raise KeyError(f"unknown parameter names in weight update: {unknown[:5]}")
            for name, t in items:  # every shape before any copy: a refused update changes nothing
                if tuple(params[name].shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(params[name].shape)}")
            with torch.no_grad():
                for name, t in items:
                    dst = params[name]
                    dst.copy_(t.to(dst.device, dst.dtype))
            self.weight_version = self.weight_version + 1 if version is None else int(version)
            self.stats["weight_updates"] += 1
            return self.weight_version

        return await self._acommand(do)

    def state_dict(self) -> dict[str, Any]:
        """``{"rng": ...}``: the sampler's generator state (requests without a ``sampling_seed``
        draw from it)."""
        return {"rng": self._gen.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; call while no request is running."""
        self._gen.set_state(state["rng"])

    async def release_memory(self) -> None:
        def do():
            if not self._running:
                self._release_memory(keep_small=True)

        await self._acommand(do)

    async def flush_cache(self) -> None:
        """Drop the prefix cache."""
        await self._acommand(self._clear_prefix)

    async def health(self) -> bool:
        return not self._closed and self._thread.is_alive()

    async def settled_stats(self) -> dict[str, float]:
        """A copy of :attr:`stats` read on the engine thread between two rounds. A request's answer
        arrives while its last round is still running, so :attr:`stats` read right after it lacks
        that round's ``time_decode_ms`` (already holding its ``time_decode_forward_ms``).

        Raises:
            EngineError: the engine thread has stopped.
        """
        return await self._acommand(lambda: dict(self.stats))

    def load(self) -> dict[str, int]:
        """Current load: unanswered, running and queued requests, tokens in the KV cache."""
        return {
            "num_reqs": self.stats["requests"] - self.stats["finished"],  # submitted, not yet answered
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting),
            "num_tokens": self._store.slots * self._store.window,
        }

    async def close(self) -> None:
        if self._closed:
            return

        def do():
            self._abort_running(self._running, "engine closed")
            for r in self._waiting:
                self._settle_output(r, {"type": "abort", "message": "engine closed"})
            self._waiting.clear()
            self._closed = True

        if self._thread.is_alive():
            await self._acommand(do)
            await asyncio.to_thread(self._thread.join, 10)
        self._closed = True

    # ------------------------------------------------------------------ thread side
    def _command(self, fn, wait=True):
        fut = None
        if wait:
            fut = asyncio.get_running_loop().create_future()
        with self._cv:
            self._commands.append((fn, fut, asyncio.get_running_loop() if wait else None))
            self._cv.notify()
        return fut

    async def _acommand(self, fn):
        if not self._thread.is_alive():
            raise EngineError("engine thread is not running")
        return await self._command(fn)

    def _run_commands(self):
        while True:
            with self._cv:
                if not self._commands:
                    return
                fn, fut, loop = self._commands.popleft()
            try:
                res, err = fn(), None
            except BaseException as e:  # report to the caller
                res, err = None, e
            if fut is not None:
                _call_soon(loop, _settle, fut, res, err)

    def _abort_running(self, requests: list[_Request], message: str) -> None:
        """Finish the running ``requests`` together, each with an abort reason."""
        if requests:
            self._finish_rows([(r, {"type": "abort", "message": message}) for r in requests])

    def _abort_rid(self, rid, message):
        self._abort_running([r for r in self._running if rid is None or r.rid == rid], message)
        for r in list(self._waiting):
            if rid is None or r.rid == rid:
                self._waiting.remove(r)
                self._settle_output(r, {"type": "abort", "message": message})

    def _narrow_window(self) -> None:
        """The store's window: the columns of its longest running row."""
        if self._running:
            self._store.lo = self._store.hi - max(r.span for r in self._running)

    def _finish_rows(self, finished: list[tuple[_Request, dict]]) -> None:
        """Finish several running rows of one decode round (each with its reason): their KV to
        the prefix cache (one copy per layer for all of them), then the rows that go on compacted
        into the freed slots, each moved at most once (one finished at a time, a row could be
        moved once per finish below it), and the store's window narrowed once."""
        position = {id(r): slot for slot, r in enumerate(self._running)}  # not list.index per row
        slots = [position[id(r)] for r, _ in finished]
        self._save_prefixes([(r, slot) for (r, _), slot in zip(finished, slots, strict=True)])
        keep = len(self._running) - len(slots)
        freed = set(slots)
        holes = sorted(slot for slot in freed if slot < keep)
        movers = [slot for slot in range(keep, len(self._running)) if slot not in freed]
        if movers:
            self._store.move(movers, holes)
        for source, hole in zip(movers, holes, strict=True):
            self._running[hole] = self._running[source]
        del self._running[keep:]
        for r, _ in finished:  # out of the running rows' index with them (after anything that can fail)
            self._running_prompts.remove(r)
        self._store.slots -= len(slots)
        self._narrow_window()
        self._settle_outputs(finished)  # once the engine's state no longer holds them

    def _settle_outputs(self, finished: list[tuple[_Request, dict]]) -> None:
        """Resolve the requests' futures with their outputs: one call into each event loop (a
        wave's rows wake their loop once, not once per row)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, reason in finished:
            by_loop.setdefault(req.loop, []).append((req.future, self._output(req, reason), None))
        for loop, settled in by_loop.items():
            _call_soon(loop, _settle_all, settled)

    def _settle_output(self, req: _Request, reason: dict) -> None:
        """Resolve ``req``'s future with its output (on its event loop)."""
        _call_soon(req.loop, _settle, req.future, self._output(req, reason), None)

    def _output(self, req: _Request, reason: dict) -> GenerateOutput:
        """``req``'s answer, counted in the stats."""
        out = GenerateOutput(
            output_ids=req.out_ids,
            output_logprobs=req.out_lp,
            finish_reason=reason,
            prompt_tokens=len(req.input_ids),
            weight_version=req.version,
            input_logprobs=req.input_lp,
            meta={"id": req.rid, "e2e_latency": time.perf_counter() - req.t_submit, "cached_tokens": req.cached},
        )
        self.stats["finished"] += 1
        self.stats[f"finish_{reason['type']}"] += 1
        return out

    def _loop(self):
        torch.set_grad_enabled(False)
        if self._device.type == "cuda":  # a new thread's current device is 0, not the model's
            torch.cuda.set_device(self._device)
        while True:
            with self._cv:
                idle = False
                while (
                    not self._closed and not self._commands and (self._paused or not (self._waiting or self._running))
                ):
                    if not idle:  # free this thread's OpenMP team for the trainer's (rl2gem.openmp)
                        release_thread_team()
                        idle = True
                    self._cv.wait()
            self._run_commands()
            if self._closed:
                return
            if self._paused:
                continue
            try:
                t0 = time.perf_counter()
                self._admit()
                t1 = time.perf_counter()
                self.stats["time_admit_ms"] += 1000 * (t1 - t0)
                admitted_ms = self.stats["time_admit_ms"]  # and within the decode (_admit_behind)
                if self._running:
                    self._decode()
                behind_ms = self.stats["time_admit_ms"] - admitted_ms
                self.stats["time_decode_ms"] += 1000 * (time.perf_counter() - t1) - behind_ms
            except Exception as e:  # a model error fails the requests, not the engine
                if self._device.type == "cuda":  # a queued round may still read what is freed below
                    with contextlib.suppress(Exception):  # a sticky CUDA error raises here too
                        torch.cuda.synchronize(self._device)
                failed = self._running + [r for r in self._admitting if r not in self._running]
                # the store may be half re-allocated (out of memory): drop it, the graphs that read it
                # and the cached prefixes before the requests end
                self._running, self._admitting, self._deferred = [], [], None
                self._running_prompts.clear()
                self._release_memory()
                for r in failed:
                    self._settle_output(r, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"})

    def _admit(self, behind: bool = False) -> bool:
        """Prefill the waiting requests that fit (``max_batch_size``, ``max_prefill_tokens``,
        ``max_cached_tokens``) and add them to the running rows (:meth:`_prefill`).

        ``behind``: a decode round is queued on the device, not yet collected
        (``decode_overlap``): the requests are admitted only where they join the KV store without
        re-allocating it (nothing may free what that round reads) and rows are running (the
        store keeps its window) and none asks for its prompt's log-probs or top-k / top-p (whose
        host reads would wait for that round), else none is taken. The prefill is then queued
        behind that round, its host work done while the round runs. -> False when ``behind``
        declined."""
        with self._cv:
            take = self._admittable()
            if behind and take and not self._joins_in_place(take):
                return False
            if behind and any(r.logprob_start_len >= 0 or filtered(r.params) for r in take):
                return False  # the prompt's log-probs and top-k / top-p read the device: after the round
            for _ in take:
                self._waiting.popleft()
        if not take:
            return True
        for r in take:
            r.version = self.weight_version
        self._admitting = take  # out of the queue: an error from here on fails them
        zero = [r for r in take if r.params.max_new_tokens == 0]
        for r in take:
            if r.logprob_start_len >= 0:
                self._input_logprobs(r)
        for r in zero:
            self._settle_output(r, {"type": "length", "length": 0})
        take = self._admitting = [r for r in take if r.params.max_new_tokens > 0]
        if not take:
            return True
        self._prefill(take, defer=behind)
        self._admitting = []
        return True

    def _admittable(self) -> list[_Request]:
        """The waiting requests (from the queue's head, left in it) that :meth:`_admit` would take
        now. Holds ``self._cv``."""
        take: list[_Request] = []
        tokens = longest = 0  # prompt tokens taken, the longest prompt taken
        window = self._store.window if self._running else 0
        for r in self._waiting:
            if len(self._running) + len(take) >= self.max_batch_size:
                break
            n = len(r.input_ids) + len(r.out_ids)
            if take and tokens + n > self.max_prefill_tokens:
                break
            if (self._running or take) and (len(self._running) + len(take) + 1) * (
                max(window, longest, n) + 1
            ) > self.max_cached_tokens:
                break
            take.append(r)
            tokens += n
            longest = max(longest, len(r.input_ids))
        return take

    def _joins_in_place(self, take: list[_Request]) -> bool:
        """Whether ``take`` prefilled would join the running rows without re-allocating the KV
        store (:meth:`_prefill`'s reservation, at most a slide of the window)."""
        if not self._running:  # an empty store is cleared, its window moved
            return False
        st = self._store
        width = max(len(r.input_ids) for r in take)  # the prefill's columns (the lean path's)
        return st.fits(st.slots + len(take), max(0, width - st.window), 1, self._growth(self._running + take))

    def _forward(self, **kw):
        return self.model(**kw, use_cache=True)

    def _input_logprobs(self, r: _Request, rows: int = 1024):
        """The prompt's log-probs from ``logprob_start_len`` on (``None`` for the first token): one
        forward whose LM head runs only from the position predicting token ``logprob_start_len``
        on (transformers' ``logits_to_keep``, where the model's forward takes it), then float32
        log-softmax ``rows`` positions at a time (the whole prompt's ``[L, V]`` in float32, three
        times over, is gigabytes at a long prompt)."""
        ids = torch.tensor([r.input_ids], device=self._device)
        first = max(r.logprob_start_len, 1)  # the first token scored (position 0 has no log-prob)
        targets = ids[0, first:, None]
        keep = len(targets) + 1  # the positions first - 1 .. L - 1 (the last one predicts nothing)
        if self._takes_logits_to_keep:
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0]
        else:
            logits = self.model(input_ids=ids, use_cache=False).logits[0, -keep:]
        t = r.params.temperature or 1.0
        parts = [
            torch.log_softmax(logits[a : min(a + rows, len(targets))].float() / t, -1).gather(1, targets[a : a + rows])
            for a in range(0, len(targets), rows)
        ]
        lp = torch.cat(parts).flatten().tolist() if parts else []
        r.input_lp = ([None] if r.logprob_start_len == 0 else []) + lp

    # ------------------------------------------------------------------ prefix cache
    def _save_prefixes(self, rows: list[tuple[_Request, int]]) -> None:
        """Keep the KV of finished rows ``(request, slot)`` so a later request that extends one (the
        next turn of the episode, or a partial rollout resuming) prefills only its new tokens."""
        st = self._store
        kept = []
        for req, slot in rows:
            if req.length >= 2:
                # a row without holes holds its tokens in the last `span` columns, before any overrun
                end = st.hi - req.overrun
                columns = slice(end - req.length, end) if req.span - req.overrun == req.length else None
                kept.append((tuple((req.input_ids + req.out_ids)[: req.length]), slot, columns))
        self._keep_kv(st, kept)

    def _keep_kv(self, store: _KVStore, rows: list[tuple[tuple[int, ...], int, slice | None]]) -> None:
        """Copy rows of ``store`` into the prefix cache, one copy per layer for all of them:
        ``(tokens, slot, columns)``, row ``slot``'s masked-in columns hold ``tokens``; ``columns``:
        where they are when the caller knows, else None (the mask of every such row is read in one
        host copy: on CUDA each read waits for the device)."""
        if self.prefix_cache_tokens <= 0 or not rows:
            return
        unknown = [slot for _, slot, columns in rows if columns is None]
        found = {}
        if unknown:
            masks = store.mask[unknown, store.lo : store.hi].cpu().numpy()
            found = {slot: np.flatnonzero(mask) + store.lo for slot, mask in zip(unknown, masks, strict=True)}
        located = []
        for tokens, slot, columns in rows:
            where = found[slot] if columns is None else np.arange(columns.start, columns.stop)
            if len(where) == len(tokens):
                located.append((tokens, slot, where))
        self._prefix_cache.keep(store.pairs, located)

    def _lookup_prefix(self, ids: list[int]) -> tuple[int, tuple | None]:
        """Longest common prefix of ``ids`` (but its last token, prefilled for its logits) with a
        cached sequence or a running row's prompt (a causal model's KV depends only on the tokens
        before it, so any shared prefix is reusable: the system prompt, a GRPO group's prompt
        whose first request is decoding, the conversation so far). -> ``(length, source)``:
        ``("cache", pool positions)`` or ``("running", slot, store columns)`` (int64 host arrays
        of ``length``), or ``(0, None)`` under ``min_prefix_match`` tokens."""
        query = ids[: len(ids) - 1]
        length, cached = self._prefix_cache.lookup(query)
        running_length, request = self._running_prompts.longest(query)
        if max(length, running_length) < self.min_prefix_match:
            return 0, None
        if running_length > length:
            slot, st = self._running.index(request), self._store
            if request.span == request.length:  # no hole: its last span columns (no read of the mask)
                columns = np.arange(st.hi - request.span, st.hi - request.span + running_length)
            else:
                columns = np.flatnonzero(st.mask[slot, st.lo : st.hi].cpu().numpy())[:running_length] + st.lo
            return running_length, ("running", slot, columns)
        return length, ("cache", self._prefix_cache.use(cached, length))

    def _shared_stems(self, take: list[_Request], cached: list[int]) -> list[list[int]]:
        """Prefixes that two or more of ``take`` share beyond their ``cached`` tokens (independent
        prompts under one system prompt or instruction): prefilled once and cached before the rows,
        which then find them as cached prefixes. Found between neighbours in sorted order."""
        if self.prefix_cache_tokens <= 0 or len(take) < 2:
            return []
        order = sorted(range(len(take)), key=lambda j: take[j].input_ids)
        stems: dict[tuple[int, ...], None] = {}
        for a, b in itertools.pairwise(order):
            x, y = take[a].input_ids, take[b].input_ids
            shared = common_prefix_length(x[: len(x) - 1], y[: len(y) - 1])  # each row keeps a token
            if shared - max(cached[a], cached[b]) >= self.min_prefix_match:
                stems[tuple(x[:shared])] = None
        return [list(stem) for stem in stems]

    def _clear_prefix(self) -> None:
        self._prefix_cache.clear()

    def _release_memory(self, keep_small: bool = False) -> None:
        """Free the KV buffers and the prefix cache (nothing is running). A trainer updates the
        weights between rollouts: the memory goes back to its update and its evaluation, and the
        next rollout allocates what it needs (a store sized for an evaluation's long episodes
        would otherwise stay for the rest of the run). ``keep_small``: KV stores that hold at
        most ``kept_kv_bytes`` together stay allocated, emptied, and so do the decode graphs that
        read them (a weight update copies in place), so the next rollout captures none again;
        the prefix cache's pool too, emptied, when it fits in what is left. A freed pool comes
        back at its last capacity at once."""
        stores = self._store.nbytes + self._prefill_store.nbytes
        keep = keep_small and stores <= self.kept_kv_bytes
        self._store.release(keep)
        self._prefill_store.release(keep)
        if keep and stores + self._prefix_cache.nbytes <= self.kept_kv_bytes:
            self._prefix_cache.clear()  # its sequences' keys are stale after an update: only the pool stays
        else:
            self._prefix_cache.release()
        if self._graphs is not None and not keep:
            self._graphs.reset()

    def _prefill(self, take: list[_Request], defer: bool = False):
        """Prefill admitted requests together (:meth:`_prefill_rows`), sample their first tokens and
        add them to the running batch, holes (masked columns) included. ``defer``: behind a queued
        decode round, the first tokens stay on the device for the round after it
        (:class:`_FirstTokens`) instead of being read and handed out now.

        Identical prompts (a GRPO group) are prefilled once and their KV copied; prefixes that
        several prompts share beyond the cache are prefilled once first (:meth:`_shared_stems`).
        """
        first_of: dict[tuple[int, ...], int] = {}
        # the first request with the same prompt: its prefill row serves every copy
        original = [first_of.setdefault(tuple(request.input_ids), index) for index, request in enumerate(take)]
        unique = [index for index in range(len(take)) if original[index] == index]
        row_of = {index: row for row, index in enumerate(unique)}
        requests, take = take, [take[index] for index in unique]
        hits = [self._lookup_prefix(request.input_ids) for request in take]
        stems = self._shared_stems(take, [hit[0] for hit in hits])
        if stems:
            width, _ = self._prefill_rows(stems, [self._lookup_prefix(stem) for stem in stems])
            lean = self._lean is not None  # each stem ends at width, no hole in it: no read of the mask
            located = [slice(width - len(stem), width) if lean else None for stem in stems]
            self._keep_kv(self._prefill_store, [(tuple(stem), row, located[row]) for row, stem in enumerate(stems)])
            hits = [self._lookup_prefix(request.input_ids) for request in take]
        # rows in the order the lean prefill groups them (most new tokens first), so each group's
        # rows are consecutive and its attention reads a view of the store
        order = sorted(range(len(take)), key=lambda j: (hits[j][0] - len(take[j].input_ids), -len(take[j].input_ids)))
        take, hits = [take[j] for j in order], [hits[j] for j in order]
        position = {old: new for new, old in enumerate(order)}
        row_of = {index: position[row] for index, row in row_of.items()}
        cached = [hit[0] for hit in hits]
        width, logits = self._prefill_rows([request.input_ids for request in take], hits)
        prefilled = self._prefill_store
        self.stats["cached_tokens"] += sum(cached) + sum(
            len(request.input_ids) for index, request in enumerate(requests) if original[index] != index
        )
        # each request's prefill row (copies of a prompt share one)
        source_rows = [row_of[original[index]] for index in range(len(requests))]
        if source_rows != list(range(len(source_rows))):  # a list index would wait for the device
            logits = logits.index_select(0, to_device(torch.tensor(source_rows), logits.device))
        tokens, logprobs = sample(logits, [r.params for r in requests], self._gen, [len(r.out_ids) for r in requests])
        # join the running batch: rows right-aligned at the window's end
        store = self._store
        if not self._running:
            store.clear()
        needed_slots = store.slots + len(requests)
        expected = min(self.max_batch_size, needed_slots + len(self._waiting))
        growth = self._growth(self._running + requests)
        store.reserve(needed_slots, max(0, width - store.window), 1, growth, expected)
        store.lo = min(store.lo, store.hi - width)
        # longest rows first: running rows are older (longer), so slots stay roughly sorted by span
        # and a decode chunk of neighbouring rows reads few columns its rows do not need. The new
        # rows are consecutive slots, copied in with one indexed copy per layer (not one per row)
        if self._lean is not None:  # each row's prompt ends at width, no hole in it
            spans = [len(request.input_ids) for request in requests]
        else:  # from each row's first column (a host read)
            sources = torch.tensor(source_rows, device=self._device)
            spans = [width - start for start in prefilled.mask[sources, :width].float().argmax(-1).tolist()]
        order = sorted(range(len(requests)), key=lambda index: -spans[index])
        sources = to_device(torch.tensor([source_rows[index] for index in order]), self._device)
        new_slots, columns = slice(store.slots, store.slots + len(requests)), slice(store.hi - width, store.hi)
        for layer in range(store.num_layers):
            store.pairs[layer][:, new_slots, :, columns] = prefilled.pairs[layer][:, sources, :, :width]
        store.mask[new_slots] = False
        store.mask[new_slots, columns] = prefilled.mask[sources, :width]
        store.slots += len(requests)
        for index in order:
            request = requests[index]
            self._running.append(request)
            self._running_prompts.insert(request, request.input_ids)
            request.length = len(request.input_ids)
            request.span = spans[index]
            request.cached = cached[source_rows[index]] if original[index] == index else len(request.input_ids)
        if defer:  # behind a queued round: the round after it reads them on the device
            self._deferred = _FirstTokens(list(requests), tokens, logprobs)
            return
        self._hand_out_first(list(requests), tokens, logprobs)

    def _hand_out_first(self, requests: list[_Request], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """The prefill's first tokens ``[n]`` (and log-probabilities) to their requests: the
        prefill's one host read, which waits for the device; everything of :meth:`_prefill` before
        it is queued without waiting (lean path). Behind a queued round the read is deferred
        instead (:meth:`_admit_behind`)."""
        self._append_tokens(requests, [tokens.tolist()], [logprobs.tolist()])

    def _prefill_rows(self, prompts: list[list[int]], hits: list) -> tuple[int, torch.Tensor]:
        """One forward over ``prompts`` into the prefill store, row ``j`` = its cached prefix
        ``hits[j]`` (from :meth:`_lookup_prefix`) + the rest of its prompt -> (columns ``width``,
        logits [rows, V] float32 after each prompt's last token); row ``j`` holds its prompt in the
        masked-in columns of ``[0, width)``, its last token at ``width - 1``.

        Lean path: each row right-aligned at ``width``, its cached prefix just before its new
        tokens, one packed forward without padding. ``model(...)`` path: cached prefixes
        right-aligned in ``[0, longest_cached)``, the new tokens left-padded after them.
        """
        rows = len(prompts)
        cached = [hit[0] for hit in hits]
        new = [len(ids) - length for ids, length in zip(prompts, cached, strict=True)]
        if self._lean is not None:
            width = max(map(len, prompts))
            prefix_end = [width - count for count in new]
        else:
            longest_cached, longest_new = max(cached), max(new)
            width = longest_cached + longest_new
            prefix_end = [longest_cached] * rows
        store = self._prefill_store  # kept between prefills: allocating it each time costs page faults
        store.slots = store.lo = store.hi = 0
        store.reserve(rows, 0, width)
        store.lo = store.hi = 0
        store.slots = rows
        self._place_prefixes(store, hits, prefix_end, new, width)
        if self._lean is not None:
            pieces = [(row, ids[cached[row] :], cached[row]) for row, ids in enumerate(prompts)]
            logits = self._lean.prefill(store, pieces, width, [width - len(ids) for ids in prompts])
        else:
            store.hi = longest_cached
            ids = torch.zeros(rows, longest_new, dtype=torch.long)
            positions = torch.zeros(rows, longest_new, dtype=torch.long)
            for row, prompt in enumerate(prompts):
                ids[row, longest_new - new[row] :] = torch.tensor(prompt[cached[row] :])
                positions[row, longest_new - new[row] :] = torch.arange(cached[row], cached[row] + new[row])
            out = self._forward(
                input_ids=ids.to(self._device),
                attention_mask=store.mask[:rows, :width],
                position_ids=positions.to(self._device),
                past_key_values=_step_cache(store),
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
        store.hi = width
        self.stats["prefill_tokens"] += sum(new)
        self.stats["prefill_forwards"] += 1
        return width, logits

    def _place_prefixes(self, store: _KVStore, hits: list, prefix_end: list[int], new: list[int], width: int) -> None:
        """Write the prefill store's first ``len(hits)`` rows before their forward: row ``j``'s cached
        prefix (``hits[j]``: its length and source, :meth:`_lookup_prefix`) ending at column
        ``prefix_end[j]``, and the mask of that prefix and of its ``new[j]`` tokens ending at
        ``width``. One mask copy, one copy of the index arrays and, per layer, one gather from the
        prefix cache's pool, one from the running rows and one write of every row's prefix (on a
        GPU a write per row and layer was a kernel each: 1,024 for 64 rows of 8 layers)."""
        rows, device = len(hits), store.mask.device
        allowed = np.zeros((rows, width), dtype=bool)
        # (row, first column, length, source): the pool's prefixes first, then the running rows'
        cached = [
            (row, prefix_end[row] - length, length, source) for row, (length, source) in enumerate(hits) if length
        ]
        cached.sort(key=lambda item: item[3][0] != "cache")
        for row, start, length, _ in cached:
            allowed[row, start : start + length] = True
        for row, count in enumerate(new):
            allowed[row, width - count : width] = True  # the new tokens end at width in both layouts
        store.mask[:rows] = False
        store.mask[:rows, :width] = to_device(torch.from_numpy(allowed), device)
        if not cached:
            return
        lengths = [length for _, _, length, _ in cached]
        running = [(source[1], source[2]) for _, _, _, source in cached if source[0] == "running"]
        arrays = [
            np.repeat([row for row, _, _, _ in cached], lengths),  # the prefill store's rows and columns
            np.concatenate([np.arange(start, start + length) for _, start, length, _ in cached]),
            np.concatenate([source[1] for _, _, _, source in cached if source[0] == "cache"] or [np.zeros(0)]),
            np.repeat([slot for slot, _ in running], [len(columns) for _, columns in running]).astype(np.int64),
            np.concatenate([columns for _, columns in running] or [np.zeros(0)]),
        ]
        token_rows, token_columns, positions, running_rows, running_columns = indexes_to_device(arrays, device)
        for layer in range(store.num_layers):
            pieces = [self._prefix_cache.read(layer, positions)] if len(positions) else []
            if running:  # the two index tensors apart: [tokens, 2, kv_heads, d]
                pieces.append(self._store.pairs[layer][:, running_rows, :, running_columns])
            store.pairs[layer][:, token_rows, :, token_columns] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _append_tokens(
        self, reqs: list[_Request], tokens: list[list[int]], logprobs: list[list[float]], ahead: int = 0
    ):
        """Give each request its sampled tokens, ``tokens[k][i]`` the ``k``-th of ``reqs[i]``, and
        finish those that stop (a stop token, their length limit or the context's).

        Every request's ``length`` and the store already count all ``len(tokens)`` steps; a request
        that stops at step ``k`` gives back the ``overrun = len(tokens) - 1 - k`` columns after it
        (their tokens are dropped and their mask cleared), so its cached prefix is exact. Row by
        row, each row's tokens appended at once (a host cost in every decode round); the rows that
        stop finish together (:meth:`_finish_rows`). ``ahead``: steps of a round launched after
        these (``decode_overlap``), which the rows' lengths and the store count too: a row that
        stops gives those columns back as well."""
        steps = len(tokens)
        finished = []  # (request, reason)
        rows, row_logprobs_all = zip(*tokens, strict=True), zip(*logprobs, strict=True)
        context_room = self.context_length + ahead + steps - 2
        given_back: dict[int, list[_Request]] = {}  # the rows that stop, by the columns they give back
        streamed: dict[asyncio.AbstractEventLoop, list] = {}  # (on_token, the row's new tokens) per loop
        for r, row, row_logprobs in zip(reqs, rows, row_logprobs_all, strict=True):
            # the first step at which r stops: a stop token, its token budget, or the context
            # (at step k the row holds length - (steps - 1 - k) tokens)
            end = min(r.params.max_new_tokens - len(r.out_ids) - 1, context_room - r.length)
            stop = steps
            if r.stop_ids and not r.stop_ids.isdisjoint(row):
                stop = next(k for k, t in enumerate(row) if t in r.stop_ids)
            end = min(max(end, 0), stop)
            if end < steps:
                row, row_logprobs = row[: end + 1], row_logprobs[: end + 1]
            r.out_ids.extend(row)
            r.out_lp.extend(row_logprobs)
            if r.on_token is not None:
                streamed.setdefault(r.loop, []).append((r.on_token, list(zip(row, row_logprobs, strict=True))))
            if end >= steps:
                continue
            reason = (
                {"type": "stop", "matched": row[end]} if end == stop else {"type": "length", "length": len(r.out_ids)}
            )
            overrun = steps - 1 - end + ahead
            if overrun:
                r.length -= overrun
                r.overrun = overrun
                given_back.setdefault(overrun, []).append(r)
            finished.append((r, reason))
        for loop, items in streamed.items():  # one wake-up per loop and round, before any answer
            _call_soon(loop, _stream_all, items)
        if given_back:  # their mask cleared: one write per count of columns, not per row
            slots = {id(running): i for i, running in enumerate(self._running)}
            hi, device = self._store.hi, self._store.mask.device
            for overrun, stopped in given_back.items():  # indexes copied without waiting for a launched round
                stopped_slots = to_device(torch.tensor([slots[id(r)] for r in stopped]), device)
                self._store.mask[stopped_slots, hi - overrun : hi] = False
        if finished:
            self._finish_rows(finished)

    def _hand_out(self, *args) -> None:
        """:meth:`_append_tokens` of a decode round, its time counted (``time_decode_handout_ms``;
        a prefill's first tokens count as admission)."""
        start = time.perf_counter()
        self._append_tokens(*args)
        self.stats["time_decode_handout_ms"] += 1000 * (time.perf_counter() - start)

    def _growth(self, reqs: list[_Request]) -> int:
        """Columns the longest of ``reqs`` may still add to the KV store."""
        return max(
            min(r.params.max_new_tokens - len(r.out_ids), self.context_length - max(r.length, len(r.input_ids)))
            for r in reqs
        )

    def _decode_logits(self, st: _KVStore, reqs: list[_Request]) -> torch.Tensor:
        """Logits ``[n, V]`` float32 of the next token of the store's ``n`` running rows, whose new
        column ``st.hi`` the caller has masked in: a replayed CUDA graph, the lean windowed
        decode, or ``model(...)``. A step that CUDA cannot capture turns the graphs off for the
        engine's life (a warning, ``stats["decode_graphs_failed"]``) and runs windowed."""
        if self._graphs is not None:
            before = self._graphs.captures, self._graphs.capture_seconds
            try:
                logits = self._graphs.decode(st, [r.out_ids[-1] for r in reqs], [r.length for r in reqs])
            except Exception as error:  # CUDA's capture errors, and dynamo's and Inductor's
                self._graphs_failed(error)  # (a built step's failure goes to the loop's error path)
            else:
                self._count_captures(*before)
                return logits
        if self._lean is not None:
            tokens = torch.tensor([r.out_ids[-1] for r in reqs], dtype=torch.long, device=self._device)
            positions = torch.tensor([r.length for r in reqs], dtype=torch.long, device=self._device)
            return self._lean.decode(st, tokens, positions, [r.span + 1 for r in reqs])
        n = st.slots
        out = self._forward(
            input_ids=torch.tensor([[r.out_ids[-1]] for r in reqs], dtype=torch.long, device=self._device),
            attention_mask=st.mask[:n, st.lo : st.hi + 1],
            position_ids=torch.tensor([[r.length] for r in reqs], dtype=torch.long, device=self._device),
            past_key_values=_step_cache(st),
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _chunk_steps(self, reqs: list[_Request]) -> int:
        """Decode steps of the next host round trip, each sampled on the device: ``decode_steps``,
        fewer only when a row's context ends sooner (no position past it); 0 when the step runs
        without graphs or a row has top-k or top-p (one step, sampled after it). Rows whose token
        budget ends inside the chunk drop the tokens past it, as after a stop token: each chunk
        length is a graph captured every rollout, so one length for the budget's tail too."""
        if self._graphs is None:
            return 0
        if any(filtered(r.params) for r in reqs):
            return 0
        context = min(self.context_length - 1 - r.length for r in reqs)
        return max(1, min(self.decode_steps, context))

    def _launch_sample(
        self, st: _KVStore, reqs: list[_Request], steps: int, last: list[int] | None, pending: int, previous=None
    ):
        """Launch ``steps`` sampled decode steps of the store's rows ``reqs`` (their last tokens
        ``last``, or None: taken on the device from the launch ``previous = (its handle, the
        rows it ran)``, and for rows admitted behind it from their prefill's first tokens, also
        on the device (:class:`_FirstTokens`);
        ``pending``: tokens each row of ``previous`` has sampled that are not in its ``out_ids``
        yet, for the seeded uniforms) -> :meth:`DecodeGraphs.collect`'s argument, or None when
        the graphs failed (they are off from then on)."""
        params = [r.params for r in reqs]
        divisors, greedy = row_settings(params)
        handle = sources = joined = None
        counts = [len(r.out_ids) + pending for r in reqs]
        if previous is not None:
            handle, ran = previous
            place = {id(r): i for i, r in enumerate(ran)}
            first = self._deferred.place if self._deferred is not None else {}
            # rows admitted behind that launch: their first token (not handed out: one pending) is
            # the deferred prefill's, on the device, at place j (source -1 - j)
            sources = [place[id(r)] if id(r) in place else -1 - first[id(r)] for r in reqs]
            if min(sources) < 0:
                joined = self._deferred.tokens
                counts = [
                    len(r.out_ids) + (pending if source >= 0 else 1) for r, source in zip(reqs, sources, strict=True)
                ]
        uniforms = draw_uniforms(params, counts, self._gen, steps)
        before = self._graphs.captures, self._graphs.capture_seconds
        try:
            launched = self._graphs.launch_sample(
                st, last, [r.length for r in reqs], divisors, greedy, uniforms, previous=handle, sources=sources,
                joined=joined,
            )  # fmt: skip
        except Exception as error:  # CUDA's capture errors, and dynamo's and Inductor's
            self._graphs_failed(error)  # (a built step's failure goes to the loop's error path)
            return None
        self._count_captures(*before)
        return launched

    def _count_captures(self, captures: int, seconds: float) -> None:
        """Add the graphs captured since ``(captures, seconds)`` to the stats."""
        self.stats["decode_graph_captures"] += self._graphs.captures - captures
        self.stats["time_capture_ms"] += 1000 * (self._graphs.capture_seconds - seconds)

    def _graphs_failed(self, error: Exception) -> None:
        """A step failed to build: a compiled one goes on uncompiled (this round captures the
        uncompiled step or runs windowed), an uncompiled one turns the graphs off for the engine's
        life (the decode runs windowed). An error raised by a built step's launch (out of memory
        in its staging or its token gather; after a replay) is re-raised instead: the loop's error
        path ends the running rows (a rollout resumes them) and frees the store with the columns
        the replay masked in, and the graphs stay on."""
        if not self._graphs.building:
            raise error
        self._graphs.reset()
        if self._graphs.compile_backend is not None:
            warnings.warn(f"decode_compile turned off, the decode graphs go on uncompiled: {error}", stacklevel=3)
            self._graphs = DecodeGraphs(self._lean, capture=self._graphs.capture)
            self._store.on_reallocate = self._graphs.reset
            self.stats["decode_compile_failed"] += 1
            return
        warnings.warn(f"decode_graphs turned off, the decode runs windowed: {error}", stacklevel=3)
        self._graphs = None
        self._store.on_reallocate = None
        self.stats["decode_graphs_failed"] += 1

    def _decode(self):
        """One decode round: sampled on the device (:meth:`_decode_on_device`), or else one step
        sampled on the host (top-k / top-p rows, no graphs, graphs that failed)."""
        st = self._store
        reqs = list(self._running)
        steps = self._chunk_steps(reqs)
        if steps and self._decode_on_device(reqs, steps):
            return
        st.reserve(st.slots, 0, 1, self._growth(reqs))
        st.mask[: st.slots, st.hi] = True
        t0 = time.perf_counter()
        logits = self._decode_logits(st, reqs)
        tokens, logprobs = sample(logits, [r.params for r in reqs], self._gen, [len(r.out_ids) for r in reqs])
        sampled = [tokens.tolist()], [logprobs.tolist()]
        self.stats["time_decode_forward_ms"] += 1000 * (time.perf_counter() - t0)
        self._advance(reqs, 1)
        self._hand_out(reqs, *sampled)

    def _advance(self, reqs: list[_Request], steps: int) -> None:
        """Count ``steps`` decode steps of the store's rows ``reqs`` (one host round trip): the
        store's columns, the rows' lengths and spans, the stats."""
        self._store.hi += steps
        for r in reqs:
            r.length += steps
            r.span += steps
        self.stats["decode_steps"] += steps
        self.stats["decode_rounds"] += 1  # host round trips
        self.stats["decode_tokens"] += len(reqs) * steps

    def _launch_round(self, reqs: list[_Request], steps: int, last: list[int] | None, pending: int, previous=None):
        """Reserve the store's next ``steps`` columns for ``reqs`` (the running rows, in slot
        order) and launch their sampled steps (``last``, ``previous``: :meth:`_launch_sample`'s);
        the rows, the store and the stats count the steps at once. -> ``(reqs, steps,
        launched)``, or None when the graphs failed (nothing counted)."""
        st = self._store
        st.reserve(st.slots, 0, steps, self._growth(reqs))  # each step masks its column in itself
        t0 = time.perf_counter()
        launched = self._launch_sample(st, reqs, steps, last, pending, previous)
        self.stats["time_decode_forward_ms"] += 1000 * (time.perf_counter() - t0)
        if launched is None:
            return None
        self._advance(reqs, steps)
        return reqs, steps, launched

    def _overlap_goes_on(self, reqs: list[_Request], pending: int) -> int:
        """Steps of a round to queue behind the launched one (whose ``pending`` tokens per row are
        not handed out yet), or 0: not when the engine has other work (a command, a pause; a
        request to admit is prefilled behind the queued round, :meth:`_decode_on_device`), no
        row's token budget goes past the launched round (a row that meets a stop token there runs
        the queued round for nothing, dropped), a row samples on the host or its context ends
        within ``decode_steps``, or the round would re-allocate the store or build a step (which
        would free or capture graphs while one runs)."""
        with self._cv:
            busy = self._commands or self._paused or self._closed
        if busy or not any(len(r.out_ids) + pending < r.params.max_new_tokens for r in reqs):
            return 0
        steps = self._chunk_steps(reqs)
        st = self._store
        if steps != self.decode_steps or not st.fits(st.slots, 0, steps, self._growth(reqs)):
            return 0
        return steps if self._graphs.ready(st, len(reqs), steps) else 0

    def _decode_on_device(self, reqs: list[_Request], steps: int) -> bool:
        """``steps`` decode steps of ``reqs`` sampled in the graphs, then, with ``decode_overlap``,
        rounds queued on the device one ahead (SGLang's overlap scheduling): the next round is
        launched before the last one's tokens are read, its rows' input tokens taken from that
        round's outputs on the device, so the device runs it while the host reads those tokens,
        hands them out, finishes the rows that stopped and stages the round after. A row that
        stopped runs the queued round too, whose tokens are dropped and whose columns are given
        back (its ``overrun``); its slot is freed behind that round on the device's queue.
        Rounds go on while nothing else waits for the engine (:meth:`_overlap_goes_on`); the last
        is read with nothing queued behind it. -> False when the first round's graphs failed
        (the caller decodes windowed)."""
        running = self._launch_round(reqs, steps, [r.out_ids[-1] for r in reqs], 0)
        if running is None:
            return False
        drain = False  # queue no more rounds: a waiting request must not join behind one
        while running is not None:
            reqs, steps, launched = running
            running = None
            # the rows that go on: those of the launched round that no earlier round stopped, and
            # the rows admitted behind it (their first token from their prefill, on the device)
            following = self._overlap_goes_on(self._running, steps) if self.decode_overlap and not drain else 0
            if following:
                nxt = list(self._running)
                running = self._launch_round(nxt, following, None, steps, previous=(launched, reqs))
                self.stats["decode_rounds_ahead"] += running is not None
            t0 = time.perf_counter()
            tokens, logprobs = DecodeGraphs.collect(launched)
            self.stats["time_decode_forward_ms"] += 1000 * (time.perf_counter() - t0)
            # the rows still running (a row that stopped in the round before ran this one too)
            alive = set(map(id, self._running))
            kept = [i for i, r in enumerate(reqs) if id(r) in alive]
            if len(kept) < len(reqs):
                reqs = [reqs[i] for i in kept]
                tokens = [[row[i] for i in kept] for row in tokens]
                logprobs = [[row[i] for i in kept] for row in logprobs]
            self._hand_out(reqs, tokens, logprobs, running[1] if running else 0)
            if self._deferred is not None:  # rows admitted behind the collected round
                self._hand_out_deferred(running)
            if running is not None and self._admission_waits():
                drain = not self._admit_behind()
        return True

    def _hand_out_deferred(self, running) -> None:
        """Hand out the first tokens of the rows prefilled behind the round just collected: read
        from pinned memory once their copy is done (the round launched after them, ``running``,
        may still run; the rows it ran carry its steps as their overrun if they stop now)."""
        deferred, self._deferred = self._deferred, None
        start = time.perf_counter()
        tokens, logprobs = deferred.read()
        overrun = running[1] if running is not None else 0  # that round ran every row admitted before it
        self._append_tokens(deferred.requests, [tokens], [logprobs], overrun)
        self.stats["time_admit_ms"] += 1000 * (time.perf_counter() - start)

    def _admission_waits(self) -> bool:
        """Whether a waiting request could join the running rows (room under ``max_batch_size``)
        and no command, pause or close comes first (a pause keeps the queue waiting, as it does
        without overlap: the loop runs the commands before it admits)."""
        with self._cv:
            if self._commands or self._paused or self._closed:
                return False
            return bool(self._waiting) and len(self._running) < self.max_batch_size

    def _admit_behind(self) -> bool:
        """:meth:`_admit` while a decode round is queued (``decode_overlap``): the prefill's host
        work (prefix lookups, staging, launches, the sampling) runs while the device runs that
        round, with no read of the device: the rows join before the next round is launched, which
        takes their first tokens on the device (:class:`_FirstTokens`), and the host reads them
        after that launch (:meth:`_hand_out_deferred`). Its time counts as admission
        (``time_admit_ms``, ``admissions_behind``).
        -> False when the requests must wait for the queued round (:meth:`_admit`'s ``behind``)."""
        start, prefills = time.perf_counter(), self.stats["prefill_forwards"]
        admitted = self._admit(behind=True)
        self.stats["time_admit_ms"] += 1000 * (time.perf_counter() - start)
        self.stats["admissions_behind"] += self.stats["prefill_forwards"] > prefills
        return admitted


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """``callback(*args)`` on ``loop`` from the engine thread; nothing when the caller closed
    its loop (no one awaits the answer: the engine goes on with the other requests)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # "Event loop is closed" (also when it closes between a check and the call)
        if not loop.is_closed():
            raise


def _stream_all(streamed: list[tuple[Callable, list[tuple[int, float]]]]) -> None:
    """Each streaming request's ``on_token`` with its ``(token, logprob)`` pairs of one round."""
    for on_token, items in streamed:
        on_token(items)


def _settle_all(settled: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, res, err in settled:
        _settle(fut, res, err)


def _settle(fut: asyncio.Future, res, err):
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)


def _load_folder(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
