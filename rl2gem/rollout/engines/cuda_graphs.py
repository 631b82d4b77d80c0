"""CUDA graphs for the embedded engine's decode step.

A decode step launched kernel by kernel from Python leaves a GPU idle: on one H200 a random
1024 x 8 Llama at 64 rows ran kernels 13% of the engine's wall time (``benchmarks/RESULTS.md``),
because a step is some 400 small kernels, each a Python call. :class:`DecodeGraphs` captures
:meth:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder.decode_all_columns` once per row bucket
and replays it, one launch per step, as vLLM and SGLang do for their decode batches.

A graph replays fixed shapes and addresses, so the captured step has neither host data nor a
shape that changes between steps:

* rows are padded to a bucket (powers of two, at most the store's rows); a padding row reads only
  its own new column, so its output is finite and never used;
* every column of the store's buffers is read under the mask, not the window the windowed
  :meth:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder.decode` slices (masked columns weigh
  exactly 0);
* the tokens, positions and the column written are one device buffer, copied in from pinned
  host memory before each replay.

A graph is tied to the store's buffers and to the weights: the store re-allocating (it grows by
half at a time, and is freed between rollouts) or a parameter replaced by another tensor drops
every graph, and the next step captures again. Weight updates copy in place
(:meth:`~rl2gem.rollout.engines.embedded.EmbeddedEngine.update_weights`), so graphs survive them.

Without CUDA (``capture=False``, the CPU) the same fixed-shape step runs eagerly: that is how its
equality with the windowed decode is tested on the CPU; the capture itself is tested under
``pytest -m gpu``. Source: PyTorch's CUDA graphs notes (``torch.cuda.graph``, warm-up on a side
stream, a memory pool shared by the graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl2gem.rollout.engines.lean_decoder import LeanDecoder

__all__ = ["DecodeGraphs", "row_bucket"]


def row_bucket(rows: int, capacity: int) -> int:
    """The padded row count of a step of ``rows`` rows: the next power of two, at most ``capacity``
    (the store's rows). Raises ``ValueError`` when ``rows`` exceeds ``capacity``."""
    if not 0 < rows <= capacity:
        raise ValueError(f"{rows} rows do not fit a store of {capacity} rows")
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, capacity)


@dataclass
class _Step:
    """One bucket's fixed-shape step: its device inputs (``[2b + 1]`` int64: tokens, positions,
    the column), their pinned host staging, the logits it writes and its graph (None: eager)."""

    inputs: torch.Tensor
    staging: torch.Tensor
    run: Any
    logits: torch.Tensor | None = None
    graph: Any = None


class DecodeGraphs:
    """Decode steps of the embedded engine's KV store through captured CUDA graphs (module
    docstring).

    Args:
        decoder: the engine's :class:`~rl2gem.rollout.engines.lean_decoder.LeanDecoder`.
        capture: capture CUDA graphs (the store on CUDA); ``False`` runs the fixed-shape step
            eagerly.
    """

    def __init__(self, decoder: LeanDecoder, capture: bool):
        self.decoder = decoder
        self.capture = capture
        self.captures = 0  # graphs captured so far (the engine's ``decode_graph_captures``)
        self._steps: dict[int, _Step] = {}
        self._key: tuple | None = None
        self._pool = None

    def reset(self) -> None:
        """Drop every graph and its memory (the next step captures again)."""
        self._steps.clear()
        self._key = None
        self._pool = None

    def _addresses(self, store) -> tuple:
        parameters = tuple(p.data_ptr() for p in self.decoder.model.parameters())
        buffers = tuple(t.data_ptr() for t in (*store.keys, *store.values, store.mask))
        return (store.capacity, buffers, parameters)

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
        bucket = row_bucket(rows, store.capacity[0])
        store.mask[rows:bucket, store.hi] = True  # padding rows read their own new column only
        key = self._addresses(store)
        if key != self._key:
            self.reset()
            self._key = key
        step = self._steps.get(bucket) or self._build(store, bucket)
        staging = step.staging
        staging[:rows] = torch.as_tensor(tokens, dtype=torch.long)
        staging[bucket : bucket + rows] = torch.as_tensor(positions, dtype=torch.long)
        staging[2 * bucket] = store.hi
        step.inputs.copy_(staging, non_blocking=True)
        if step.graph is None:
            logits = step.run()
        else:
            step.graph.replay()
            logits = step.logits
        return logits[:rows]

    def _build(self, store, bucket: int) -> _Step:
        device = store.mask.device
        inputs = torch.zeros(2 * bucket + 1, dtype=torch.long, device=device)
        staging = torch.zeros(2 * bucket + 1, dtype=torch.long, pin_memory=self.capture)
        keys = [k[:bucket] for k in store.keys]
        values = [v[:bucket] for v in store.values]
        mask = store.mask[:bucket]

        def run() -> torch.Tensor:
            return self.decoder.decode_all_columns(
                keys, values, mask, inputs[:bucket], inputs[bucket : 2 * bucket], inputs[2 * bucket :]
            )

        step = _Step(inputs, staging, run)
        if self.capture:
            # warm-up and capture write column store.hi, which this very step writes again
            inputs[2 * bucket :].fill_(store.hi)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(device).wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self._pool, capture_error_mode="thread_local"):
                step.logits = run()
            if self._pool is None:
                self._pool = step.graph.pool()
            self.captures += 1
        self._steps[bucket] = step
        return step
