"""The text-environment API of rl2gem.

An :class:`Env` is a :class:`gymnasium.Env` whose observations and actions are
strings (:class:`TextSpace`, a :class:`gymnasium.spaces.Text`). It has the usual
synchronous ``reset`` / ``step`` and asynchronous twins ``areset`` / ``astep``.

Writing an environment
----------------------
Subclasses implement *hooks*, and the public methods do the bookkeeping that
every environment needs (seeding, action validation, turn limit, ``info``
defaults, order checks):

* a compute-only env implements ``_reset(options)`` and ``_step(action)``
  (plain functions). Its ``areset`` / ``astep`` run them in a worker thread, so
  they never block the caller's event loop.
* an env that does I/O (HTTP search, tool processes) implements the coroutines
  ``_areset(options)`` and ``_astep(action)``. Its ``reset`` / ``step`` run
  them on a private event loop in a background thread, so the sync API works
  anywhere, also inside a running loop.

``_reset`` returns ``(observation, info)``; ``_step`` returns
``(observation, reward, terminated, truncated, info)``. The action a hook
receives is already a valid ``str`` (see :meth:`Env.step`). Randomness must come
from ``self.np_random``, which ``reset`` seeds before calling the hook.

Observations are deltas
-----------------------
The observation returned by ``step`` is only what is new for the agent this
turn (the env's reply), never a re-rendered history. ``info["role"]`` tells the
chat role of that text: ``"user"`` (feedback, the next question) or ``"tool"``
(a tool or search result). This is what lets the rollout append the env's reply
as tokens after the model's own tokens without re-tokenising the conversation.
:class:`rl2gem.wrappers.ChatHistory` rebuilds the full message list when
evaluation code wants it.

Copies
------
``copy.deepcopy`` and ``pickle`` copy an env with its episode (task, turn,
history, ``np_random``, an env's back-ends such as BFCL's file system), to
branch an episode (tree search, GRPO groups from a mid-episode state) or to
send it to another process. A copy never shares a running resource with its
original: it starts its own private event loop, HTTP sessions, retrieval
client or MCP connection on first use (and closes it when it closes), so
closing either leaves the other working. ``copy.copy`` is shallow, as for any
Python object: it gets a loop of its own but shares the wrapped env of a
wrapper, mutable attributes (a tool dict, a board) and ``np_random``, so it
does not branch an episode. State that lives outside the process cannot be copied and
raises ``TypeError`` naming it: a persistent Python session's interpreter
(:class:`rl2gem.tools.PythonSession`) once it ran, a :class:`rl2gem.remote.RemoteEnv`'s
episode on its server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import math
import numbers
import operator
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded
from gymnasium.spaces.utils import flatten, flatten_space, unflatten
from gymnasium.vector.utils import read_from_shared_memory

__all__ = [
    "Env",
    "TextSpace",
    "Wrapper",
    "StepResult",
    "ResetResult",
    "fit_observation",
    "fit_tool_results",
    "MAX_OBSERVATION_CHARS",
    "MAX_ACTION_CHARS",
    "VALID_ROLES",
]

#: Default upper bound (characters) of an observation string.
MAX_OBSERVATION_CHARS = 65_536
#: Default upper bound (characters) of an action string. About 4x the longest
#: generation budgets in common RL recipes (4-8k tokens of ~4 chars).
MAX_ACTION_CHARS = 32_768
#: Chat roles an observation may take.
VALID_ROLES = ("user", "tool")

#: Characters :meth:`TextSpace.sample` draws from: printable ASCII.
SAMPLE_CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"

StepResult = tuple[str, float, bool, bool, dict[str, Any]]
ResetResult = tuple[str, dict[str, Any]]

T = TypeVar("T")


class TextSpace(spaces.Text):
    """A :class:`gymnasium.spaces.Text` of arbitrary Unicode strings.

    Membership: any ``str`` of ``min_length`` to ``max_length`` characters
    (Python ``len``, i.e. Unicode code points) that is encodable as UTF-8
    (no lone surrogates). Gymnasium's ``Text`` keeps an explicit character set,
    which for all of Unicode would be 1.1 million entries; this subclass checks
    UTF-8 encodability instead and keeps ``charset`` (printable ASCII, newline
    and tab) only for :meth:`sample`. Gymnasium's ``flatten`` gives its Unicode
    code points (int32, padded with :data:`TEXT_PADDING`), which is also how
    Gymnasium's process vector env carries it through shared memory
    (:class:`SharedTexts`).

    Args:
        max_length: the longest valid string, in characters.
        min_length: the shortest valid string, in characters (default 0).
        seed: seed of the sampling RNG.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None):
        super().__init__(max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        if not isinstance(x, str) or not (self.min_length <= len(x) <= self.max_length):
            return False
        if x.isascii():
            return True
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random printable-ASCII string of at most ``min(max_length, 64)`` characters.

        Long random strings are useless as test actions and slow, so the length
        is capped at 64 unless ``mask`` gives one.
        """
        if mask is None and probability is None:
            hi = max(self.min_length, min(self.max_length, 64))
            length = int(self.np_random.integers(self.min_length, hi + 1))
            return super().sample(mask=(length, None))
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"TextSpace({self.min_length}, {self.max_length}, charset=unicode)"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TextSpace) and self.min_length == other.min_length and self.max_length == other.max_length
        )

    __hash__ = None  # type: ignore[assignment]  # mutable RNG inside, like other spaces


#: The padding of a flattened :class:`TextSpace` string: one past the last Unicode code point.
TEXT_PADDING = 0x110000


@flatten.register(TextSpace)
def _flatten_text(space: TextSpace, x: str) -> np.ndarray:
    """A string as ``max_length`` int32 code points, padded with :data:`TEXT_PADDING` (Gymnasium's
    ``Text`` takes indices into its character set, which holds printable ASCII only here)."""
    points = np.frombuffer(x.encode("utf-32-le"), dtype="<i4")
    if len(points) > space.max_length:
        raise ValueError(
            f"a text of {len(points)} characters does not fit {space!r} (rl2gem.core.fit_observation cuts it)"
        )
    flat = np.full(space.max_length, TEXT_PADDING, dtype=np.int32)
    flat[: len(points)] = points
    return flat


@unflatten.register(TextSpace)
def _unflatten_text(space: TextSpace, x: np.ndarray) -> str:
    points = np.asarray(x, dtype=np.int32)
    # a surrogate (a point of the flattened Box no string flattens to) reads as U+FFFD
    return points[points < TEXT_PADDING].astype("<u4").tobytes().decode("utf-32-le", errors="replace")


@flatten_space.register(TextSpace)
def _flatten_text_space(space: TextSpace) -> spaces.Box:
    return spaces.Box(low=0, high=TEXT_PADDING, shape=(space.max_length,), dtype=np.int32)


def fit_observation(text: str, space: Any) -> str:
    """``text`` cut to the ``max_length`` of the observation ``space`` (a :class:`TextSpace`;
    other spaces leave it as it is), its end marked ``[... observation truncated]``: an env's own
    text and what wrappers add (tool results, the tool prompt)."""
    limit = getattr(space, "max_length", None)
    return text if limit is None else _cut(text, limit)


def fit_tool_results(results: Sequence[str], space: Any) -> list[str]:
    """A turn's tool ``results``, each cut to an equal share of the observation ``space``'s
    ``max_length`` (as :func:`fit_observation`): the rollout renders them one message each
    (``info["tool_results"]``), not the observation that joins them."""
    limit = getattr(space, "max_length", None)
    if limit is None or not results:
        return list(results)
    return [_cut(text, max(1, limit // len(results))) for text in results]


def _cut(text: str, limit: int) -> str:
    if len(text) > limit:
        marker = "\n[... observation truncated]"
        text = text[: limit - len(marker)] + marker if limit > len(marker) else text[:limit]  # no room: cut only
    return text


class SharedTexts(Sequence):
    """The strings of a vector env's :class:`TextSpace` observations in shared memory, decoded
    when read. ``gymnasium.vector.AsyncVectorEnv(shared_memory=True)`` (its default) reads the
    shared memory once, at its start, and relies on the result being a view, as an array's is; a
    tuple of strings read then would be every later observation (Gymnasium 1.4 does that for
    ``Text``: all blanks). ``copy.deepcopy`` (the vector env's ``copy=True``, its default) gives a
    ``tuple`` of ``str``, as the sync vector env returns. With ``copy=False`` the observations
    are this live sequence: it indexes, slices, compares, orders and concatenates as that tuple
    does, but it is no ``tuple`` (``json.dumps`` and a space's ``contains`` want ``tuple(obs)``)."""

    def __init__(self, space: TextSpace, memory: Any, n: int):
        self.space, self.rows = space, np.frombuffer(memory.get_obj(), dtype=np.int32).reshape(n, space.max_length)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(unflatten(self.space, row) for row in self.rows[index])
        return unflatten(self.space, self.rows[operator.index(index)])  # as a tuple: no list or mask

    def _as_tuple(self, other: object, operation: Callable[[tuple, tuple], Any], reflected: bool = False) -> Any:
        """``operation`` of this sequence and ``other`` as tuples, with a tuple or another
        ``SharedTexts`` only (a ``str`` or ``list`` is no tuple's equal either)."""
        if not isinstance(other, (tuple, SharedTexts)):
            return NotImplemented
        ours, theirs = tuple(self), tuple(other)
        return operation(theirs, ours) if reflected else operation(ours, theirs)

    __eq__ = functools.partialmethod(_as_tuple, operation=operator.eq)
    __lt__ = functools.partialmethod(_as_tuple, operation=operator.lt)
    __le__ = functools.partialmethod(_as_tuple, operation=operator.le)
    __gt__ = functools.partialmethod(_as_tuple, operation=operator.gt)
    __ge__ = functools.partialmethod(_as_tuple, operation=operator.ge)
    __add__ = functools.partialmethod(_as_tuple, operation=operator.add)
    __radd__ = functools.partialmethod(_as_tuple, operation=operator.add, reflected=True)
    __hash__ = None  # type: ignore[assignment]  # its contents change

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return tuple(self)

    def __reduce__(self) -> tuple:
        """Pickled as the ``tuple`` of its strings now (another process has no view of them)."""
        return tuple, (tuple(self),)

    def __repr__(self) -> str:
        return repr(tuple(self))


@read_from_shared_memory.register(TextSpace)
def _read_texts(space: TextSpace, shared_memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(space, shared_memory, n)


class _PrivateLoop:
    """An event loop running forever in a daemon thread, for the sync API of async envs.

    ``owner`` (the env, vector env or wrapper that runs it; ``None`` for a loop stopped at once):
    when it is garbage-collected without ``close()``, the loop stops, and the thread closes it
    (its self-pipe; its default executor's threads end once idle) and ends. Before, every
    unclosed owner kept a thread and two file descriptors for the life of the process."""

    def __init__(self, owner: object | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=_serve_until_stopped, args=(self.loop,), name="rl2gem-env-loop", daemon=True
        )
        self.thread.start()
        self._finalizer = None
        if owner is not None:
            self._finalizer = weakref.finalize(owner, _request_stop, self.loop)
            self._finalizer.atexit = False  # at exit the daemon thread just ends

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Stop the loop and wait up to 5 s for its thread, which closes it."""
        if self._finalizer is not None:
            self._finalizer.detach()
        _request_stop(self.loop)
        self.thread.join(timeout=5)


def _serve_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    """The private loop's thread: run ``loop`` until it is stopped, then close it (its default
    executor is shut down without waiting: a job still running there ends on its own) once its
    async generators are closed (an HTTP session left open there, :class:`rl2gem.aio.LoopSessions`)."""
    loop.run_forever()
    try:
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


def _request_stop(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop`` from any thread (its owner was collected); nothing once it is closed."""
    with contextlib.suppress(RuntimeError):  # closed already
        loop.call_soon_threadsafe(loop.stop)


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(Env, name)


@functools.cache
def _async_native(cls: type) -> bool:
    native = _overrides(cls, "_astep")
    if native != _overrides(cls, "_areset"):
        raise TypeError(
            f"{cls.__name__} must implement either both _areset/_astep (async I/O env) "
            "or both _reset/_step (compute-only env)"
        )
    if not native and not (_overrides(cls, "_step") and _overrides(cls, "_reset")):
        raise TypeError(f"{cls.__name__} implements neither _reset/_step nor _areset/_astep")
    for name in ("_reset", "_step", "_areset", "_astep"):
        coroutine = inspect.iscoroutinefunction(inspect.unwrap(getattr(cls, name)))  # through functools.wraps
        if _overrides(cls, name) and coroutine != name.startswith("_a"):
            kind, twin = (
                ("an async def", name.replace("_a", "_", 1))
                if name.startswith("_a")
                else ("a plain def", "_a" + name[1:])
            )
            raise TypeError(
                f"{cls.__name__}.{name} must be {kind}: the coroutine hooks are _areset/_astep (an env that "
                f"does I/O), the plain ones _reset/_step; rename it {twin} or change its def"
            )
    return native


class Env(gym.Env[str, str]):
    """Base class of rl2gem text environments (a :class:`gymnasium.Env`).

    Spaces: ``observation_space = TextSpace(MAX_OBSERVATION_CHARS)`` and
    ``action_space = TextSpace(MAX_ACTION_CHARS)`` unless a subclass sets others; each env gets
    copies of its class's, so seeding or sampling one env's space leaves the others' alone.

    Args:
        max_turns: truncate the episode after this many ``step`` calls
            (``None``: no limit). ``info["truncated_reason"] == "max_turns"``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the latest
            observation, or what the subclass's ``render_text`` returns).

    Class attributes a subclass may set:
        invalid_action_reward: reward of an action rejected as invalid (0.0).
        invalid_action_terminates: whether an invalid action ends the episode
            (``False``; single-turn envs set ``True``).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}
    observation_space: spaces.Space = TextSpace(MAX_OBSERVATION_CHARS)
    action_space: spaces.Space = TextSpace(MAX_ACTION_CHARS)
    invalid_action_reward: ClassVar[float] = 0.0
    invalid_action_terminates: ClassVar[bool] = False
    max_turns: int | None = None
    render_mode: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any):
        self = super().__new__(cls)
        # Remembered so that clone()/spawn() can build identical copies.
        self._init_args = (args, dict(kwargs))
        return self

    def __init__(self, *, max_turns: int | None = None, render_mode: str | None = None) -> None:
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be a positive int or None, got {max_turns!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']} or None, got {render_mode!r}")
        self.max_turns = max_turns
        self.render_mode = render_mode
        for name in ("observation_space", "action_space"):  # a class's space: one RNG for every env
            if name not in self.__dict__:
                setattr(self, name, copy.deepcopy(getattr(self, name)))

    # ------------------------------------------------------------------ hooks
    def _reset(self, options: dict[str, Any] | None) -> ResetResult:
        raise NotImplementedError

    def _step(self, action: str) -> StepResult:
        raise NotImplementedError

    async def _areset(self, options: dict[str, Any] | None) -> ResetResult:
        raise NotImplementedError

    async def _astep(self, action: str) -> StepResult:
        raise NotImplementedError

    async def _aclose(self) -> None:
        """Release async resources (sessions, processes) of an async-native env."""

    def _close(self) -> None:
        """Release resources of a sync env."""

    @property
    def is_async_native(self) -> bool:
        """True when the env implements the coroutine hooks (it does I/O)."""
        return _async_native(type(self))

    # ---------------------------------------------------------- public API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> ResetResult:
        """Start an episode.

        Args:
            seed: the episode seed. The same seed gives the same task; with
                ``None`` the episode seed is drawn from a stream seeded by the
                last explicit seed (or OS entropy before any), so a seeded
                reset followed by unseeded ones is reproducible.
            options: env-specific options (e.g. ``{"index": 3}`` picks item 3 of a data-set env).

        Returns:
            ``(observation, info)``; ``info["seed"]`` is the episode seed
            (``reset(seed=info["seed"])`` replays the episode's initial state),
            ``info["role"]`` the chat role of the observation.
        """
        if self.is_async_native:
            return self._loop_run(self.areset(seed=seed, options=options))
        self._begin_episode(seed, options)
        return self._finish_reset(self._reset(options))

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> ResetResult:
        """Coroutine twin of :meth:`reset`; a compute-only env runs in a worker thread."""
        if not self.is_async_native:
            return await asyncio.to_thread(self.reset, seed=seed, options=options)
        self._begin_episode(seed, options)
        return self._finish_reset(await self._areset(options))

    def step(self, action: str) -> StepResult:  # type: ignore[override]
        """Take one turn.

        ``action`` is the agent's text. An action that is not a valid string
        (not ``str``/``bytes``, bytes that are not UTF-8, lone surrogates,
        empty or whitespace-only, longer than ``action_space.max_length``)
        never raises: the env answers with a feedback observation,
        ``invalid_action_reward`` and ``info["invalid_action"]`` set to the
        reason; ``info["num_invalid_actions"]`` counts them in the episode.
        Env-specific format errors are reported the same way by the subclass
        (see :meth:`invalid_action`).

        Returns:
            ``(observation, reward, terminated, truncated, info)``: the
            observation is only the env's new reply; ``info["role"]`` its role;
            ``info["turn"]`` the number of steps taken in the episode.

        Raises:
            gymnasium.error.ResetNeeded: if called before ``reset`` or after
                the episode has ended.
        """
        if self.is_async_native:
            return self._loop_run(self.astep(action))
        text, reason = self._begin_step(action)
        try:
            result = self._rejected(reason) if reason else self._step(text)
        finally:
            self._stepping = False
        return self._finish_step(result)

    async def astep(self, action: str) -> StepResult:
        """Coroutine twin of :meth:`step`; a compute-only env runs in a worker thread."""
        if not self.is_async_native:
            return await asyncio.to_thread(self.step, action)
        text, reason = self._begin_step(action)
        try:
            result = self._rejected(reason) if reason else await self._astep(text)
        finally:
            self._stepping = False
        return self._finish_step(result)

    def close(self) -> None:
        """Release resources. Safe to call more than once."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if self.is_async_native:
                # Resources opened on another loop through astep() should be closed with aclose().
                self._loop_run(self._aclose())
            else:
                self._close()
        finally:  # the loop's thread ends even when the close hook raised
            loop: _PrivateLoop | None = getattr(self, "_private_loop", None)
            if loop is not None:
                loop.stop()
                self._private_loop = None

    async def aclose(self) -> None:
        """Coroutine twin of :meth:`close`, to call from the loop that used ``astep``."""
        if getattr(self, "_closed", False):
            return
        if self.is_async_native:
            self._closed = True
            await self._aclose()
            loop = getattr(self, "_private_loop", None)
            if loop is not None:
                loop.stop()
                self._private_loop = None
        else:
            await asyncio.to_thread(self.close)

    def render(self) -> str | None:  # type: ignore[override]
        """With ``render_mode="ansi"``: the text of :meth:`render_text`."""
        if self.render_mode != "ansi":
            return None
        return self.render_text()

    def render_text(self) -> str:
        """A text picture of the current state; by default the latest observation."""
        return getattr(self, "_last_observation", "")

    # -------------------------------------------------------------- helpers
    def invalid_action(
        self, reason: str, observation: str | None = None, *, terminated: bool | None = None, **info: Any
    ) -> StepResult:
        """Build the step result of an action the env cannot use.

        Args:
            reason: short machine-readable reason, stored in ``info["invalid_action"]``.
            observation: the feedback shown to the agent (default: a sentence
                built from ``reason``).
            terminated: end the episode (default ``invalid_action_terminates``).
            **info: extra info entries.
        """
        if observation is None:
            observation = f"Invalid action: {reason}. Please try again."
        if terminated is None:
            terminated = self.invalid_action_terminates
        info["invalid_action"] = reason
        return observation, float(self.invalid_action_reward), bool(terminated), False, info

    def task_index(self, size: int, options: dict[str, Any] | None) -> int:
        """The task of this episode in a data set of ``size`` items: ``options["index"]``
        when given (evaluation in order), else drawn from ``self.np_random`` (seeded).

        Raises:
            IndexError: ``options["index"]`` outside ``0..size-1``.
        """
        if options and "index" in options:
            index = int(options["index"])
            if not 0 <= index < size:
                raise IndexError(f"task index {index} out of range 0..{size - 1}")
            return index
        return int(self.np_random.integers(size))

    def clone(self) -> Env:
        """A new env built with the same constructor arguments (not reset)."""
        args, kwargs = self._init_args
        twin = type(self)(*args, **kwargs)
        twin.spec = self.spec
        return twin

    def spawn(self, n: int) -> tuple[list[Env], list[str], list[dict[str, Any]]]:
        """``n`` new envs, each reset to this env's current episode's initial state.

        This is how a GRPO group of ``n`` responses to the same prompt is made.

        Returns:
            ``(envs, observations, infos)``, each of length ``n``.

        Raises:
            gymnasium.error.ResetNeeded: if this env was never reset.
            ValueError: if ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"spawn needs n >= 1, got {n}")
        if getattr(self, "_episode_seed", None) is None:
            raise ResetNeeded("spawn() copies the current episode: call reset() first")
        envs, observations, infos = [], [], []
        for _ in range(n):
            twin = self.clone()
            obs, info = twin.reset(seed=self._episode_seed, options=self._episode_options)
            envs.append(twin)
            observations.append(obs)
            infos.append(info)
        return envs, observations, infos

    @property
    def turn(self) -> int:
        """Steps taken in the current episode."""
        return getattr(self, "_turn", 0)

    def __getstate__(self) -> dict[str, Any]:
        """The state ``copy``, ``deepcopy`` and ``pickle`` take: everything but the private event
        loop (a copy starts its own on first use; see the module's "Copies")."""
        state = dict(self.__dict__)
        state.pop("_private_loop", None)
        state.pop("_stepping", None)  # a copy taken during a step is not in one
        return state

    # ------------------------------------------------------------- internals
    def action_rng(self, rng: np.random.Generator | None = None) -> np.random.Generator:
        """The generator a ``sample_random_action(rng=None)`` draws from: ``rng`` when given, else
        the episode's own action stream, seeded from its seed (``info["seed"]``) apart from
        ``np_random``. Sampling an action then never changes what the env itself draws
        (Minesweeper places its mines at the first reveal), and one seed samples the same actions.
        Before any reset: the action space's generator."""
        if rng is not None:
            return rng
        seed = getattr(self, "_episode_seed", None)
        if seed is None:
            return self.action_space.np_random
        if getattr(self, "_action_rng", None) is None:  # made at the first draw: a reset costs nothing more
            self._action_rng = np.random.default_rng([seed, 0x61_63_74])
        return self._action_rng

    def _loop_run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = getattr(self, "_private_loop", None)
        if loop is None:
            loop = self._private_loop = _PrivateLoop(self)
        return loop.run(coro)

    def _begin_episode(self, seed: int | None, options: dict[str, Any] | None) -> None:
        if seed is not None:
            if not isinstance(seed, (int, np.integer)) or seed < 0:
                raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
            seed = int(seed)
            self._seed_stream = np.random.default_rng([seed, 0x72_6C_32])
        else:
            stream = getattr(self, "_seed_stream", None)
            if stream is None:
                stream = self._seed_stream = np.random.default_rng()
            seed = int(stream.integers(0, 2**31 - 1))
        # What gymnasium.Env.reset(seed=seed) does (the same PCG64 stream from
        # SeedSequence(seed)), without its argument checks: 5 us less per episode.
        self._np_random = np.random.default_rng(seed)
        self._np_random_seed = seed
        self._episode_seed = seed
        self._action_rng = None
        self._episode_options = options
        self._turn = 0
        self._num_invalid = 0
        self._episode_over = True  # until the reset hook returns: a reset that raised opens no episode
        self._closed = False

    def _finish_reset(self, result: ResetResult) -> ResetResult:
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"{type(self).__name__} reset hook must return (observation, info), got {result!r:.200}")
        obs, info = result
        obs, info = self._fit_observation(obs), self._checked_info(info, "reset")
        self._episode_over = False
        info.setdefault("role", "user")
        info["seed"] = self._episode_seed
        self._last_observation = obs
        return obs, info

    def _begin_step(self, action: Any) -> tuple[str, str | None]:
        if getattr(self, "_episode_seed", None) is None:
            raise ResetNeeded("Cannot call step() before reset()")
        if self._episode_over:
            raise ResetNeeded("The episode has ended (terminated or truncated): call reset() first")
        if getattr(self, "_stepping", False):  # a second step would run on the first's episode state
            raise RuntimeError("step() called while another step() of this env runs: one step at a time per env")
        self._stepping = True
        if isinstance(action, (bytes, bytearray)):
            try:
                action = bytes(action).decode("utf-8")
            except UnicodeDecodeError:
                return "", "the action is not valid UTF-8 text"
        if not isinstance(action, str):
            return "", f"the action must be text, got {type(action).__name__}"
        if not action.isascii():
            try:
                action.encode("utf-8")
            except UnicodeEncodeError:
                return "", "the action is not valid UTF-8 text"
        if not action.strip():
            return "", "the action is empty"
        limit = getattr(self.action_space, "max_length", None)
        if limit is not None and len(action) > limit:
            return "", f"the action is {len(action)} characters long; the limit is {limit}"
        return action, None

    def _rejected(self, reason: str) -> StepResult:
        return self.invalid_action(reason, **self.unscored_info())

    def unscored_info(self) -> dict[str, Any]:
        """Info entries of a step that does not score the episode (an action rejected before the
        step hook: empty, too long, not UTF-8): what the env reports for an episode cut short
        (e.g. SearchQA's em 0 and its searches so far), so the last step's info still has them.
        Override in envs that report per-episode numbers; the default is none."""
        return {}

    def _finish_step(self, result: StepResult) -> StepResult:
        try:
            obs, reward, terminated, truncated, info = result
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{type(self).__name__} step hook must return (obs, reward, terminated, truncated, info), got {result!r}"
            ) from e
        obs, info = self._fit_observation(obs), self._checked_info(info, "step")
        reward, terminated, truncated = self._checked_step_values(reward, terminated, truncated)
        self._turn += 1
        if info.get("invalid_action"):
            self._num_invalid += 1
        else:
            info["invalid_action"] = None
        info["num_invalid_actions"] = self._num_invalid
        info["turn"] = self._turn
        info.setdefault("role", "user")
        if info["role"] not in VALID_ROLES:
            raise ValueError(f"info['role'] must be one of {VALID_ROLES}, got {info['role']!r}")
        if not terminated and not truncated and self.max_turns is not None and self._turn >= self.max_turns:
            truncated = True
            info["truncated_reason"] = "max_turns"
        self._episode_over = terminated or truncated
        self._last_observation = obs
        return obs, reward, terminated, truncated, info

    def _checked_info(self, info: Any, hook: str) -> dict[str, Any]:
        if not isinstance(info, dict):
            raise TypeError(f"{type(self).__name__} {hook} hook returned info {info!r:.200}; it must be a dict")
        return dict(info)

    def _checked_step_values(self, reward: Any, terminated: Any, truncated: Any) -> tuple[float, bool, bool]:
        """``(float(reward), terminated, truncated)`` from a step hook; anything but a finite real
        reward and ``bool`` flags is a bug of the env's (``bool("False")`` is True)."""
        name = type(self).__name__
        if getattr(reward, "shape", None) == () and hasattr(
            reward, "item"
        ):  # a NumPy scalar or 0-d array, a 0-d tensor
            reward = reward.item()
        if not isinstance(reward, numbers.Real):
            raise TypeError(
                f"{name} step hook returned reward {reward!r:.200} ({type(reward).__name__}); it must be a float"
            )
        if not math.isfinite(reward):
            raise ValueError(f"{name} step hook returned reward {reward!r}; it must be finite")
        for flag, value in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(
                    f"{name} step hook returned {flag}={value!r:.200} ({type(value).__name__}); it must be a bool"
                )
        return float(reward), bool(terminated), bool(truncated)

    def _fit_observation(self, obs: Any) -> str:
        if not isinstance(obs, str):
            raise TypeError(f"{type(self).__name__} returned a {type(obs).__name__} observation; it must be str")
        return fit_observation(obs, self.observation_space)

    def __repr__(self) -> str:
        env_id = self.spec.id if self.spec is not None else type(self).__name__
        return f"<{env_id}>"


class Wrapper(gym.Wrapper[str, str, str, str]):
    """A :class:`gymnasium.Wrapper` for rl2gem envs that also forwards the async API.

    Subclasses override ``step``/``astep`` as they need and change reset results
    in the ``_on_reset(obs, info)`` hook; by default everything forwards to the wrapped env.
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)

    def _on_reset(self, obs: str, info: dict[str, Any]) -> ResetResult:
        """Hook: change the wrapped env's reset result (both ``reset`` and ``areset`` call it)."""
        return obs, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> ResetResult:
        return self._on_reset(*self.env.reset(seed=seed, options=options))

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> ResetResult:
        if self._sync_only("reset"):
            return await asyncio.to_thread(self.reset, seed=seed, options=options)
        return self._on_reset(*await self.env.areset(seed=seed, options=options))  # type: ignore[attr-defined]

    async def astep(self, action: str) -> StepResult:
        if self._sync_only("step"):
            return await asyncio.to_thread(self.step, action)
        return await self.env.astep(action)  # type: ignore[attr-defined]

    async def inner_astep(self, action: str) -> StepResult:
        """The wrapped env's ``astep``, or its sync ``step`` in a thread where a Gymnasium
        wrapper below has no async twin: what a subclass's ``astep`` forwards to."""
        if hasattr(self.env, "astep"):
            return await self.env.astep(action)  # type: ignore[attr-defined]
        return await asyncio.to_thread(self.env.step, action)

    def _sync_only(self, method: str) -> bool:
        """Whether ``a<method>`` must run this wrapper's sync ``method`` (in a thread): a subclass
        that overrides ``step`` (``reset``) but not its async twin, whose forward would skip it,
        or a Gymnasium wrapper below (TimeLimit...), which has no async twins."""
        cls = type(self)
        overridden = getattr(cls, method) is not getattr(Wrapper, method, getattr(gym.Wrapper, method))
        return (overridden and getattr(cls, "a" + method) is getattr(Wrapper, "a" + method)) or not hasattr(
            self.env, "a" + method
        )

    async def aclose(self) -> None:
        """Close the wrapped env: its ``aclose``, or its ``close`` in a thread when it has no async
        twin (a Gymnasium wrapper below, such as ``gym.make(..., max_episode_steps=N)``'s TimeLimit)."""
        if hasattr(self.env, "aclose"):
            await self.env.aclose()  # type: ignore[attr-defined]
        else:
            await asyncio.to_thread(self.env.close)

    def spawn(self, n: int):
        """Spawn from the wrapped env; the copies are not wrapped."""
        return self.env.spawn(n)  # type: ignore[attr-defined]

    @property
    def is_async_native(self) -> bool:
        """The wrapped env's, unless this wrapper's async twins run its sync methods."""
        if self._sync_only("step") or self._sync_only("reset"):
            return False
        return bool(getattr(self.env, "is_async_native", False))
