"""The engine interface every rollout engine implements.

An engine turns token ids into token ids: ``generate(input_ids, sampling_params)``
returns the generated ids exactly as sampled, the log-probability of each, and
why generation stopped. Nothing is decoded and re-tokenised on the way (TITO,
token-in/token-out). Three engines implement it: the in-process
:class:`~rl2gem.rollout.engines.embedded.EmbeddedEngine`, the HTTP client
:class:`~rl2gem.rollout.engines.http.HTTPEngine` (our embedded server, SGLang
servers, or an sglang-router in front of either), and
:class:`~rl2gem.rollout.engines.sglang.SGLangEngine` (launches SGLang on GPUs).

Field names follow SGLang's native ``/generate`` API so one vocabulary is used
end to end: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``no_stop_trim``; finish reasons
``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` and
``{"type": "abort", "message": ...}``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rl2gem.config import closest_hint

__all__ = ["SamplingParams", "GenerateOutput", "Engine", "EngineError", "seeded_uniform", "seeded_uniforms", "mix_seed"]


class EngineError(RuntimeError):
    """An engine could not serve a request (bad parameters, server gone, ...)."""


_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, k: int) -> float:
    """A uniform in [0, 1) that is a fixed function of ``(seed, k)`` (SplitMix64 finaliser).

    Used for the k-th sampled token of a request with ``sampling_seed``, so a seeded request
    draws the same uniforms in any batch. Its tokens are the same up to the logits' float rounding:
    batches of other sizes can change the logits in their last bits (about 1e-6), which flips a
    draw that lands among tail tokens holding about that much probability each.
    """
    return (_splitmix(int(seed) * 0x9E3779B97F4A7C15 + (int(k) + 1) * 0xBF58476D1CE4E5B9) >> 11) / float(1 << 53)


def seeded_uniforms(seeds: Sequence[int], counts: np.ndarray) -> np.ndarray:
    """:func:`seeded_uniform` of many ``(seed, k)`` pairs at once: ``seeds`` ``[n]`` (any Python
    ints), ``counts`` int64 ``[..., n]`` -> float64 ``[..., n]``, equal element by element (uint64
    arithmetic wraps modulo 2**64 as the scalar version masks)."""
    z = np.asarray([int(s) & _MASK64 for s in seeds], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = z + (np.asarray(counts).astype(np.uint64) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (e.g. run seed, group id, sample, turn)."""
    z = 0
    for p in parts:
        z = _splitmix(z ^ (int(p) & _MASK64))
    return z >> 1


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _is_whole(value: Any) -> bool:
    """An integer (a float with no fraction, as JSON may send one, too), not a bool or a string."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, (int, np.integer))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    Attributes:
        max_new_tokens: upper bound on generated tokens (>= 0).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        stop_token_ids: extra token ids that end generation (the model's EOS
            always does unless ``ignore_eos``). The stop token is kept in the
            output ids: it is part of the action the trainer learns from.
        ignore_eos: do not stop at the EOS token.
        no_stop_trim: accepted for SGLang compatibility; output ids always
            keep the stop token.
        sampling_seed: per-request seed (SGLang's name). With a seed, the
            uniform behind the k-th sampled token is a fixed function of
            ``(sampling_seed, k)``, so the same prompt, weights and seed give the
            same tokens whatever else is in the batch (up to float rounding of
            the logits). ``None`` draws from the engine's generator.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    def __post_init__(self):
        # every field checked and coerced here, where a request is refused alone: a bad value that
        # reached the engine's thread failed every request running with it
        whole = {"max_new_tokens": self.max_new_tokens, "top_k": self.top_k, "sampling_seed": self.sampling_seed}
        for name, value in whole.items():
            if value is not None and not _is_whole(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.integer, np.floating))
                or value != value
            ):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if int(self.max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        stops = tuple(self.stop_token_ids or ())
        if not all(_is_whole(t) for t in stops):
            raise ValueError(f"stop_token_ids must be integers, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        for name in ("max_new_tokens", "top_k"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.sampling_seed is not None:
            object.__setattr__(self, "sampling_seed", int(self.sampling_seed))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("ignore_eos", "no_stop_trim"):
            value = getattr(self, name)
            if value not in (True, False):  # a bool, or 0 / 1
                raise ValueError(f"{name} must be true or false, got {value!r}")
            object.__setattr__(self, name, bool(value))

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a dict with SGLang's key names.

        Raises:
            ValueError: an unknown key (the message names the closest valid key)
                or an out-of-range value.
        """
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in params if k not in names]
        if unknown:
            hint = closest_hint(unknown[0], names, otherwise=f"; valid: {sorted(names)}")
            raise ValueError(f"unknown sampling parameter {unknown[0]!r}{hint}")
        return cls(**{k: v for k, v in params.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if d["sampling_seed"] is None:  # servers without seeded sampling reject the key
            del d["sampling_seed"]
        return d


@dataclasses.dataclass
class GenerateOutput:
    """One completion.

    Attributes:
        output_ids: generated token ids, as sampled (stop token included).
        output_logprobs: float log-probability of each generated token under the
            temperature-scaled distribution ``log_softmax(logits / T)`` (T = 1
            for greedy), before top-k/top-p truncation; same length as
            ``output_ids``. This is what a trainer computing
            ``log_softmax(logits / T)`` reproduces.
        finish_reason: ``{"type": "stop", "matched": id}``,
            ``{"type": "length", "length": n}`` or ``{"type": "abort", ...}``.
        prompt_tokens: number of input tokens.
        weight_version: the engine's weight version that produced every output
            token (engines abort in-flight requests before loading weights, so
            one request never spans two versions).
        input_logprobs: when requested, the log-probability of each input token
            from ``logprob_start_len`` on given its prefix (``None`` for a token
            with no prefix).
        meta: anything else the engine reports (request id, cached tokens...).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: int = 0
    input_logprobs: list[float | None] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


class Engine(abc.ABC):
    """Async generation engine (see module docstring).

    All methods are coroutines and safe to call from many coroutines at once.
    """

    #: incremented by every weight update
    weight_version: int = 0

    @abc.abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        rid: str | None = None,
    ) -> GenerateOutput:
        """Sample a completion of ``input_ids``.

        Raises:
            ValueError: empty or out-of-vocabulary input, bad sampling parameters.
            EngineError: the engine is closed or unreachable.
        """

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> AsyncIterator[tuple[int, float] | GenerateOutput]:
        """:meth:`generate`, streamed: yields ``(token_id, logprob)`` as tokens are sampled, then
        the :class:`GenerateOutput`. This default yields every token once the completion is done
        (an engine without token streaming, e.g. a remote server behind ``/generate``);
        :class:`~rl2gem.rollout.engines.embedded.EmbeddedEngine` yields each decode round's tokens as
        the round ends.

        Raises:
            as :meth:`generate`.
        """
        out = await self.generate(input_ids, sampling_params, return_logprob=True, rid=rid)
        for token, logprob in zip(out.output_ids, out.output_logprobs, strict=True):
            yield token, logprob
        yield out

    @abc.abstractmethod
    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``mode="abort"``: in-flight requests return at once with
        the tokens generated so far and ``finish_reason["type"] == "abort"``; queued
        and new requests wait until :meth:`resume`. ``mode="in_place"``: in-flight
        requests keep their state and continue on resume."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue after :meth:`pause`."""

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume` (partial rollouts leave the engine paused
        between collects; evaluation resumes it for its own requests)."""
        return bool(getattr(self, "_paused", False))

    @abc.abstractmethod
    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or all in-flight and queued requests."""

    @abc.abstractmethod
    async def update_weights(
        self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]] | str, version: int | None = None
    ) -> int:
        """Load new weights: a state dict / iterable of ``(name, tensor)``, or a
        folder of safetensors files. In-flight requests are aborted first.
        Returns the new weight version."""

    async def release_memory(self) -> None:  # noqa: B027 (an optional hook, like close)
        """Free caches kept between requests (KV buffers, the prefix cache) when nothing is running;
        a trainer calls it between its rollout and its update. Engines in another process keep them;
        the embedded engine keeps a small KV store (``kept_kv_bytes``)."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine answers."""

    async def close(self) -> None:  # noqa: B027 (an optional hook: engines without resources keep it)
        """Release resources; idempotent."""

    def state_dict(self) -> dict[str, Any]:
        """Engine state a trainer checkpoints so that a resumed run samples as the uninterrupted
        one would (e.g. the sampling RNG); empty for engines whose sampling is seeded per request."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional, like state_dict)
        """Restore :meth:`state_dict` (call between requests)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
