"""CUDA graphs for the embedded engine's decode step.

A decode step launched kernel by kernel from Python leaves a GPU idle: on one H200 a random
1024 x 8 Llama at 64 rows ran kernels 13% of the engine's wall time (``benchmarks/RESULTS.md``),
because a step is some 400 small kernels, each a Python call. :class:`DecodeGraphs` captures
:meth:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder.decode_all_columns` once per row bucket
and replays it, one launch per step, as vLLM and SGLang do for their decode batches.

A graph replays fixed shapes and addresses, so the captured step has neither host data nor a
shape that changes between steps:

* rows are padded to a bucket (powers of two from 8, at most the store's rows); a padding row
  reads only its own new column, so its output is finite and never used;
* every column of the store's buffers is read under the mask, not the window the windowed
  :meth:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder.decode` slices (masked columns weigh
  exactly 0);
* the tokens, positions and the column written are one device buffer, copied in from pinned
  host memory before each replay.

A decode step is one launch, but reading its tokens back is a host round trip in which the GPU
waits for Python (sampling, the scheduler). So the step the engine replays is ``steps`` decode
steps (``EmbeddedEngine(decode_steps=4)`` on CUDA), each followed by the sampling
(:func:`~rl2gem.rollout.engines.sampling.sample_rows`: temperatures, greedy flags and uniforms
staged with the tokens) whose token the next step reads from device memory, and writing its
column's mask entry itself; the host reads ``[steps, rows]`` tokens and log-probabilities once
and drops those past a row's stop token (vLLM's multi-step scheduling, with the same cost: up to
``steps - 1`` wasted steps of a row that stops).

A graph is tied to the store's buffers and to the weights: the store re-allocating (it grows by
half at a time) or being freed drops every graph first (``_KVStore.on_reallocate``: the graphs
hold views of its buffers, which would otherwise outlive it), and so does a parameter replaced by
another tensor; the next step captures again. Weight updates copy in place. Between rollouts a
trainer releases the engine's memory
(:meth:`~rl2gem.rollout.engines.embedded.EmbeddedEngine.release_memory`, for its update): a store
of at most ``kept_kv_bytes`` (5% of the GPU by default) stays allocated and its graphs with it, so
after the first rollout none is captured again; a larger store is freed, and the next rollout
allocates it once at the size the last one needed and captures its buckets again
(``decode_graph_captures``, ``time_capture_ms``).

Without CUDA (``capture=False``, the CPU) the same fixed-shape step runs eagerly, after the same
warm-up a capture has: that is how its equality with the windowed decode is tested on the CPU;
the capture itself is tested under ``pytest -m gpu``. Source: PyTorch's CUDA graphs notes
(``torch.cuda.graph``, warm-up on a side stream, a memory pool shared by the graphs).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl2gem.rollout.engines.lean_decoder import LeanDecoder
from rl2gem.rollout.engines.sampling import sample_rows

__all__ = ["DecodeGraphs", "SMALLEST_BUCKET", "row_bucket"]


SMALLEST_BUCKET = 8  # fewer rows pad to 8: a decode step of so few rows is launch-bound anyway
COMPILED_VARIANTS = 32  # dynamo's recompile limit with a compiled decode step (an entry per engine)


def row_bucket(rows: int, capacity: int) -> int:
    """The padded row count of a step of ``rows`` rows: the next power of two from
    :data:`SMALLEST_BUCKET` on, at most ``capacity`` (the store's rows). Each bucket is a graph
    captured again every rollout, so fewer buckets are fewer captures (a rollout whose rows finish
    one by one passes through every bucket). Raises ``ValueError`` when ``rows`` exceeds
    ``capacity``."""
    if not 0 < rows <= capacity:
        raise ValueError(f"{rows} rows do not fit a store of {capacity} rows")
    bucket = SMALLEST_BUCKET
    while bucket < rows:
        bucket *= 2
    return min(bucket, capacity)


def _constant_numbers(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile``'d function with dynamic shapes) traced with the Python
    ints and floats it reads as constants (the head counts and ``head_dim``, a norm's epsilon, the
    attention's scaling) and without duck shaping. Otherwise dynamo makes those numbers symbols
    and 0-d tensor inputs (and traced the step twice on its first call), and gives equal sizes one
    symbol with a guard that they stay equal: a first store whose rows equal ``head_dim`` or its
    own columns would compile the step again for every later store. Only the tensors' sizes stay
    dynamic. The settings matter only while dynamo traces, at a graph's warm-up; a replay calls
    nothing."""

    def call(*args):
        with (
            torch._dynamo.config.patch(specialize_int=True, specialize_float=True),
            torch.fx.experimental._config.patch(use_duck_shape=False),
        ):
            return compiled(*args)

    return call


def _sample_rows_opaque_scan(logits, divisors, greedy, uniforms):
    """:func:`~rl2gem.rollout.engines.sampling.sample_rows` with its cumulative sum an opaque
    operator (what :class:`_CompiledSampling` compiles)."""
    return sample_rows(logits, divisors, greedy, uniforms, opaque_scan=True)


class _CompiledSampling:
    """:func:`~rl2gem.rollout.engines.sampling.sample_rows` compiled with dynamic rows, or eager
    once its compilation failed (a warning; ``error`` keeps why), so that the compiled decode step
    goes on without it rather than the whole compilation being turned off.

    The compilation reads the logits ``[n, V]`` with ``V`` static, and the cumulative sum over
    ``V`` stays ATen's kernel (:func:`~rl2gem.rollout.engines.sampling.cumulative_sum`): on the
    H100 (torch 2.11, 2026-11-28) Inductor's code generation failed on the scan it generated
    (``TypeError: list indices must be integers or slices, not NoneType``). Dynamo's and
    Inductor's errors (``TorchDynamoException``) outside a capture turn to the eager sampling,
    which reads the same logits (a compilation fails before anything runs); other errors (out of
    memory, a capture's) propagate."""

    def __init__(self, compile_options: dict):
        self.compiled = _constant_numbers(torch.compile(_sample_rows_opaque_scan, **compile_options))
        self.error: Exception | None = None

    def __call__(self, logits: torch.Tensor, *rest) -> tuple[torch.Tensor, torch.Tensor]:
        if self.error is None:
            torch._dynamo.mark_static(logits, 1)
            try:
                return self.compiled(logits, *rest)
            except torch._dynamo.exc.TorchDynamoException as error:  # dynamo's and Inductor's
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # a capture's own error: the engine turns the graphs off
                warnings.warn(
                    f"the sampling's compilation failed, it runs eagerly in the compiled step: {error}", stacklevel=2
                )
                self.error = error
        return sample_rows(logits, *rest)


@dataclass
class _Step:
    """One fixed-shape step of a bucket: its device inputs (``ints`` ``[3b + 1]`` int64: tokens,
    positions, the column, and for a launch that takes its tokens from the one before, each row's
    place in that launch; ``floats`` ``[(2 + steps) b]`` float32 for a sampling step: divisors,
    greedy flags, uniforms), their pinned host staging, what it writes (logits, or the tokens and
    log-probabilities of its steps with their pinned host copies) and its graph (None: eager).

    A sampling step's staging, host copies and events are two sets, used in turn by its launches:
    a launch may be staged while the one before it (maybe of this step) is still queued on the
    device (:meth:`DecodeGraphs.launch_sample`'s ``previous``), whose copies must not be
    overwritten; the set a launch uses was last used two launches of this step before, which the
    engine has collected by then."""

    ints: torch.Tensor
    int_staging: tuple[torch.Tensor, ...]
    floats: torch.Tensor | None
    float_staging: tuple[torch.Tensor, ...] | None
    run: Any
    outputs: tuple[torch.Tensor, ...] = ()
    host_outputs: tuple[tuple[torch.Tensor, ...], ...] = ()  # per set
    done: tuple = ()  # per set, a CUDA event recorded after a launch's copies to the host
    graph: Any = None
    turn: int = 0  # the set the next launch uses


class DecodeGraphs:
    """Decode steps of the embedded engine's KV store through captured CUDA graphs (module
    docstring).

    Two kinds of step are captured, each per row bucket: :meth:`decode` (one step, logits out:
    rows with top-k or top-p are sampled eagerly after it) and :meth:`launch_sample` with
    :meth:`collect` (``steps`` decode steps, each followed by
    :func:`~rl2gem.rollout.engines.sampling.sample_rows` and fed the token it sampled, tokens and
    log-probabilities out: one launch and one host round trip for ``steps`` tokens per row).

    Args:
        decoder: the engine's :class:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder`.
        capture: capture CUDA graphs (the store on CUDA); ``False`` runs the fixed-shape steps
            eagerly.
        compile_backend: ``torch.compile`` the decode step and the sampling with this backend
            (a name or a backend callable) before they are captured (``"inductor"``: fused
            kernels, so fewer of them per graph; compiled once with dynamic shapes, for every
            row bucket and store size, on the first capture: tens of seconds), or None: captured
            as the model's modules launch them. A captured step is a sequence of kernels, and on the
            H200 a 1024 x 8 Llama's step of some 400 small kernels took about 1.1 ms of GPU time
            at 64 rows, the kernels' own latency rather than their work
            (``benchmarks/RESULTS.md``); fusing the norms, rotary embedding, MLP activation and
            softmax cuts their count. A sampling whose compilation fails runs eagerly in the
            compiled step (:class:`_CompiledSampling`); a decode step whose compilation fails
            turns the compilation off (the engine's ``decode_compile_failed``).
    """

    def __init__(self, decoder: LeanDecoder, capture: bool, compile_backend: str | Callable | None = None):
        self.decoder = decoder
        self.capture = capture
        self.compile_backend = compile_backend
        self._decode_columns = decoder.decode_all_columns
        self._sample_rows = sample_rows
        if compile_backend is not None:
            # dynamic shapes from the start: one compilation serves every bucket and store size. The
            # undecorated function (the engine thread runs without grad): ``torch.no_grad``'s wrapper
            # is one code object shared by every decorated function, and so would be dynamo's cache
            # entries and its recompile limit; engines of other models add entries, hence the limit
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)
            step = types.MethodType(inspect.unwrap(LeanDecoder.decode_all_columns), decoder)
            options = {"backend": compile_backend, "fullgraph": True, "dynamic": True}
            self._decode_columns = _constant_numbers(torch.compile(step, **options))
            self._sample_rows = _CompiledSampling(options)
        self._generation = 0  # how many times the model's modules were found replaced
        self._find_slots()
        self.captures = 0  # graphs captured so far (the engine's ``decode_graph_captures``)
        self.capture_seconds = 0.0  # their warm-up and capture, device synchronised (``time_capture_ms``)
        # a step is being built (warmed up, compiled, captured): an error raised meanwhile is the
        # build's (the engine turns the compilation or the graphs off); raised after, a launch's
        self.building = False
        self._steps: dict[tuple[int, int], _Step] = {}
        self._key: tuple | None = None
        self._pool = None

    def reset(self) -> None:
        """Drop every graph and its memory (the next step captures again)."""
        self._steps.clear()
        self._key = None
        self._pool = None

    def _find_slots(self) -> None:
        """Walk the model once: (each module's table of submodules, a name in it, the submodule)
        for every submodule, and (each module's parameter table, a name in it) for every
        parameter (tied ones once)."""
        modules = list(self.decoder.model.modules())
        self._module_slots = [
            (module._modules, name, child) for module in modules for name, child in module._modules.items()
        ]
        self._parameter_slots = [
            (module._parameters, name)
            for module in modules
            for name, parameter in module._parameters.items()
            if parameter is not None
        ]

    def _addresses(self, store) -> tuple:
        """What the captured steps are tied to: the store's size and buffers, the model's modules
        and every parameter's storage. Read from the slots found once (``model.parameters()``
        walks every module: about 0.5 ms per round on the 2-core CPU for an 8-layer model, a host
        cost in every decode round), so a parameter replaced in its module, or given other data,
        is still seen; a module replaced (a layer, an adapter wrapping a projection, which may
        keep its parameters) finds the slots again and counts a new generation."""
        if any(table.get(name) is not child for table, name, child in self._module_slots):
            self._find_slots()
            self._generation += 1
        parameters = tuple(table[name].data_ptr() for table, name in self._parameter_slots)
        buffers = tuple(t.data_ptr() for t in (*store.pairs, store.mask))
        return (store.capacity, buffers, self._generation, parameters)

    def _step(self, store, rows: int, steps: int) -> tuple[_Step, int]:
        """The step of ``rows`` rows (``steps`` 0: logits out), built on first use -> (it, bucket)."""
        bucket = row_bucket(rows, store.capacity[0])
        key = self._addresses(store)
        if key != self._key:
            self.reset()
            self.decoder.check_fused()  # a replaced parameter may have broken a fused projection
            self._key = key
        step = self._steps.get((bucket, steps)) or self._build(store, bucket, steps)
        return step, bucket

    def _stage_ints(
        self, step: _Step, bucket: int, store, tokens: list[int] | None, positions: list[int], turn: int = 0,
        sources: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Stage the rows' tokens (None: taken on the device, see ``sources``), positions and the
        column in the step's host set ``turn`` and queue its copy to the device."""
        rows = len(positions)
        staging = step.int_staging[turn].numpy()
        if tokens is not None:
            staging[:rows] = tokens
        staging[bucket : bucket + rows] = positions
        staging[2 * bucket] = store.hi
        if sources is not None:
            staging[2 * bucket + 1 : 2 * bucket + 1 + rows] = sources
        step.ints.copy_(step.int_staging[turn], non_blocking=True)

    @staticmethod
    def _last_sampled(previous: tuple) -> torch.Tensor:
        """The tokens ``[its bucket]`` int64 that the launch ``previous`` sampled at its last step,
        on the device (maybe not yet written)."""
        before, _, eager, _ = previous
        return (eager[0] if eager is not None else before.outputs[0])[-1]

    @classmethod
    def _take_tokens(cls, step: _Step, bucket: int, rows: int, previous: tuple, joined: torch.Tensor | None) -> None:
        """Queue on the device: each row's input token is the last one the launch ``previous``
        sampled for it (its place there staged in ``ints[2b + 1:]``); ``joined``: the first tokens
        of rows admitted after that launch, on the device, whose places follow its bucket
        (``bucket_previous + j``). Stream order puts it after that launch's steps and the
        admission's prefill, before this launch's (and before a replay of the same step overwrites
        those outputs)."""
        sampled = cls._last_sampled(previous)
        if joined is not None:
            sampled = torch.cat((sampled, joined))
        step.ints[:rows] = sampled.index_select(0, step.ints[2 * bucket + 1 : 2 * bucket + 1 + rows])

    @classmethod
    def _token_sources(
        cls, previous: tuple, rows: int, sources: list[int] | None, joined: torch.Tensor | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each row's place in the launch ``previous``'s last sampled tokens followed by
        ``joined`` (None when no row joined after it), checked on the host: an index out of range
        would be a device-side assert on CUDA, which poisons the context."""
        width = cls._last_sampled(previous).shape[0]  # where the joined tokens follow its own
        if sources is None or len(sources) != rows:
            raise ValueError(f"a launch behind another needs one source per running row ({rows})")
        admitted = max([0] + [-source for source in sources])  # joined tokens read (source -1 - j)
        if admitted == 0:
            joined = None  # no row admitted after that launch
        elif joined is None or joined.shape[0] < admitted:
            raise ValueError(f"rows admitted after the launch they come from need {admitted} joined tokens")
        if max(sources, default=-1) >= width:
            raise ValueError(f"a source row {max(sources)} beyond the launch's {width} rows")
        return [source if source >= 0 else width - 1 - source for source in sources], joined

    def ready(self, store, rows: int, steps: int) -> bool:
        """Whether a launch of ``rows`` rows and ``steps`` steps would replay a step already built
        for the store as it is (no capture, nothing freed: what a launch queued behind another
        needs, so the one before it keeps its graph and memory)."""
        return self._key == self._addresses(store) and (row_bucket(rows, store.capacity[0]), steps) in self._steps

    @torch.no_grad()
    def decode(self, store, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of the store's ``store.slots`` running rows.

        Args:
            store: the engine's KV store; the new keys and values go to column ``store.hi``, whose
                mask entry the caller has set for the running rows.
            tokens: the last sampled token of each running row.
            positions: its position id.

        Returns:
            logits ``[store.slots, V]`` float32 on the store's device (a view of the graph's
            output: read it before the next step).
        """
        rows = store.slots
        step, bucket = self._step(store, rows, 0)
        store.mask[rows:bucket, store.hi] = True  # padding rows read their own new column only
        self._stage_ints(step, bucket, store, tokens, positions)  # read at once: one set is enough
        if step.graph is None:
            (logits,) = step.run()
        else:
            step.graph.replay()
            (logits,) = step.outputs
        return logits[:rows]

    @torch.no_grad()
    def launch_sample(
        self,
        store,
        tokens: list[int] | None,
        positions: list[int],
        divisors: list[float],
        greedy: list[bool],
        uniforms: np.ndarray,
        previous: tuple | None = None,
        sources: list[int] | None = None,
        joined: torch.Tensor | None = None,
    ) -> tuple[_Step, int, tuple | None, int]:
        """Launch ``steps = len(uniforms)`` decode steps of the store's ``n = store.slots``
        running rows, each sampling the token the next one reads: staged and replayed, their
        tokens' copies to the host queued behind them, not waited for (:meth:`collect` waits).

        Args:
            store: the engine's KV store; step ``k`` writes column ``store.hi + k`` and masks it in
                for every row of the bucket (the caller makes room for ``steps`` columns).
            tokens, positions: the last sampled token of each running row and its position id;
                with ``previous``, row ``i``'s token is its last one of the launch ``previous``
                (not collected yet, maybe still running), being that launch's row ``sources[i]``:
                read on the device, so this launch is queued behind that one with no host round
                trip between them (SGLang's overlap scheduling); ``tokens`` is None then.
            divisors, greedy: each row's temperature (1 for greedy rows) and whether it is greedy
                (:func:`~rl2gem.rollout.engines.sampling.row_settings`).
            uniforms: ``[steps, n]`` float32, row ``i``'s draw at step ``k``
                (:func:`~rl2gem.rollout.engines.sampling.draw_uniforms`).
            previous, sources: see ``tokens``; ``previous`` is what this method returned for it.
            joined: ``[m]`` int64 on the device, the first tokens of rows admitted after the launch
                ``previous`` (a prefill behind it, not read by the host yet): such a row ``i`` has
                ``sources[i] = -1 - j``, its token being ``joined[j]``.

        Returns:
            what :meth:`collect` takes. Collect a launch before the launch after next of its
            (bucket, steps): a step's staging and host copies are two sets used in turn.

        Raises:
            ValueError: not one of ``tokens`` and ``previous``; with ``previous``, not one source
                per row, a source beyond its rows, or fewer ``joined`` tokens than the negative
                sources read.
        """
        if (tokens is None) == (previous is None):
            raise ValueError("give the rows' tokens or the launch they come from")
        rows, steps = store.slots, len(uniforms)
        if previous is not None:
            sources, joined = self._token_sources(previous, rows, sources, joined)
        step, bucket = self._step(store, rows, steps)
        turn, step.turn = step.turn, 1 - step.turn
        self._stage_ints(step, bucket, store, tokens, positions, turn, sources)
        staging = step.float_staging[turn].numpy()
        staging[: 2 * bucket] = 1.0  # padding rows: greedy at temperature 1 (finite, never read)
        staging[:rows] = divisors
        staging[bucket : bucket + rows] = greedy
        staging[2 * bucket :].reshape(steps, bucket)[:, :rows] = uniforms
        step.floats.copy_(step.float_staging[turn], non_blocking=True)
        if previous is not None:
            self._take_tokens(step, bucket, rows, previous, joined)
        if step.graph is None:
            return step, rows, step.run(), turn
        step.graph.replay()
        for host, device in zip(step.host_outputs[turn], step.outputs, strict=True):
            host.copy_(device, non_blocking=True)
        step.done[turn].record()  # what collect waits for: not the work queued after the launch
        return step, rows, None, turn

    @staticmethod
    def collect(launched: tuple[_Step, int, tuple | None, int]) -> tuple[list[list[int]], list[list[float]]]:
        """The tokens and log-probabilities ``[steps][n]`` of a :meth:`launch_sample`, as host
        lists: waits for that launch's replay and copies only (not for a launch queued after it)."""
        step, rows, eager, turn = launched
        if eager is not None:
            sampled, logprobs = eager
        else:
            step.done[turn].synchronize()
            sampled, logprobs = step.host_outputs[turn]
        return sampled[:, :rows].tolist(), logprobs[:, :rows].tolist()

    def _build(self, store, bucket: int, steps: int) -> _Step:
        self.building = True  # cleared when the step is built (an error leaves it set)
        device = store.mask.device
        ints = torch.zeros(3 * bucket + 1, dtype=torch.long, device=device)
        int_staging = tuple(torch.zeros(3 * bucket + 1, dtype=torch.long, pin_memory=self.capture) for _ in range(2))
        keys = [k[:bucket] for k in store.keys]
        values = [v[:bucket] for v in store.values]
        # one write of a layer's keys and values when eager (decode_all_columns: not compiled)
        pairs = [pair[:, :bucket] for pair in store.pairs] if self.compile_backend is None else None
        mask = store.mask[:bucket]
        # built before a step that a compilation traces or a graph captures reads it
        self.decoder.rotation_table(self.decoder.model.model.embed_tokens.weight.dtype, device)
        floats = float_staging = None

        def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """The staged tokens, positions and column as tensors of their own, as the later steps
            of a sampling step get them (views of ``ints`` would be a second compiled variant)."""
            return ints[:bucket].clone(), ints[bucket : 2 * bucket].clone(), ints[2 * bucket : 2 * bucket + 1].clone()

        def logits_only() -> tuple[torch.Tensor]:
            return (self._decode_columns(keys, values, mask, *inputs(), pairs),)

        run = logits_only
        if steps:
            # ones until staged: the warm-up before a capture samples greedily at temperature 1
            floats = torch.ones((2 + steps) * bucket, dtype=torch.float32, device=device)
            float_staging = tuple(
                torch.zeros((2 + steps) * bucket, dtype=torch.float32, pin_memory=self.capture) for _ in range(2)
            )

            def run() -> tuple[torch.Tensor, torch.Tensor]:
                """-> tokens and log-probabilities ``[steps, bucket]``: stacked once (a captured
                graph's outputs keep their addresses), not copied out step by step."""
                token, position, column = inputs()
                divisors, greedy = floats[:bucket], floats[bucket : 2 * bucket] > 0.5
                uniforms = floats[2 * bucket :].view(steps, bucket)
                tokens, logprobs = [], []
                for k in range(steps):
                    mask.index_fill_(1, column, True)
                    logits = self._decode_columns(keys, values, mask, token, position, column, pairs)
                    token, logprob = self._sample_rows(logits, divisors, greedy, uniforms[k])
                    tokens.append(token)
                    logprobs.append(logprob)
                    if k + 1 < steps:
                        position, column = position + 1, column + 1
                return torch.stack(tokens), torch.stack(logprobs)

        step = _Step(ints, int_staging, floats, float_staging, run)
        self._warm_up_and_capture(step, store, bucket, steps)
        if step.graph is not None and steps:
            step.host_outputs = tuple(
                tuple(torch.empty_like(t, device="cpu").pin_memory() for t in step.outputs) for _ in range(2)
            )
            step.done = (torch.cuda.Event(), torch.cuda.Event())
        self._steps[(bucket, steps)] = step
        self.building = False
        return step

    def _warm_up_and_capture(self, step: _Step, store, bucket: int, steps: int) -> None:
        """Run ``step`` twice, on a side stream when capturing, then capture it into a graph
        (PyTorch's CUDA graphs notes; the warm-up runs on the CPU too, where nothing is captured,
        so the CPU tests run what a capture runs).

        The warm-up writes the keys and values of columns ``store.hi`` to ``store.hi + steps - 1``
        (which the step writes again before reading them) and, in a sampling step, masks them in
        for the bucket's rows: their mask entries are restored, or the first replay's step ``k``
        would attend to the warm-up's keys at the columns after its own."""
        start = time.perf_counter()
        device = store.mask.device
        columns = slice(store.hi, store.hi + steps)
        saved = store.mask[:bucket, columns].clone()
        step.ints[2 * bucket : 2 * bucket + 1].fill_(store.hi)
        side = torch.cuda.Stream(device) if self.capture else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                try:
                    for _ in range(2):
                        step.run()
                finally:  # also after a failed run, whose first steps masked their columns in
                    store.mask[:bucket, columns] = saved
        finally:
            if side is not None:
                torch.cuda.current_stream(device).wait_stream(side)
        if side is not None:
            step.graph = torch.cuda.CUDAGraph()
            # the outer context puts this thread's stream back when the capture fails: torch.cuda.graph
            # restores it only after a capture that ended (its capture_end raises first otherwise)
            capture = torch.cuda.graph(step.graph, pool=self._pool, stream=side, capture_error_mode="thread_local")
            with torch.cuda.stream(side), capture:
                step.outputs = step.run()
            if self._pool is None:
                self._pool = step.graph.pool()
            self.captures += 1
            torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - start
