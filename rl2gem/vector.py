"""Vector envs: many text envs stepped together.

:class:`AsyncVectorEnv` is asyncio-native: ``astep`` steps the chosen envs
concurrently with their ``astep`` coroutines (an env doing HTTP waits without
holding anything up), bounded by ``max_concurrency``. :class:`SyncVectorEnv`
steps them one after another with ``step``, for debugging. Both are
:class:`gymnasium.vector.VectorEnv` subclasses with the same API:

* ``reset(seed=None, options=None, indices=None) -> (observations, infos)``
* ``step(actions) -> (observations, rewards, terminations, truncations, infos)``

``actions`` is either a sequence with one action per env, or a mapping
``{env_index: action}`` to step only a subset (multi-turn rollouts step only
the envs whose model turn has finished). Results cover the stepped envs, in
the order of their indices: ``observations`` and ``infos`` are lists (one
``str`` / one ``dict`` per env: text infos are ragged, so they are not packed
into Gymnasium's dict of arrays; so Gymnasium's own vector wrappers, which expect
that dict, e.g. ``gymnasium.wrappers.vector.RecordEpisodeStatistics``, do not
apply), ``rewards`` is a float32 array of shape ``(k,)`` and ``terminations`` /
``truncations`` bool arrays of shape ``(k,)``.

Autoreset follows Gymnasium 1.x ``NEXT_STEP`` semantics: the step that ends an
episode returns its final observation and info untouched; the *next* step of
that env ignores its action, resets the env and returns the new episode's first
observation with reward 0, ``terminated = truncated = False`` and
``info["autoreset"] = True``. The last finished episode of env ``i`` stays in
``final_observations[i]`` / ``final_infos[i]``.

``autoreset_mode=AutoresetMode.SAME_STEP`` (Gymnasium's other mode, GEM's
default) resets within the finishing step instead: it returns the new
episode's first observation with the finishing reward and flags, and the
final observation and info in ``info["final_obs"]`` / ``info["final_info"]``.
In lock-step stepping this saves the one step per episode that NEXT_STEP
spends on the reset.

An env whose step raises does not break the batch: its slot returns a
truncated step (observation ``""``, reward 0) with ``info["error"]`` (the
exception) and ``info["traceback"]``, and the env is reset (at its next step,
or at once with SAME_STEP). An env whose reset raises there reports
``info["reset_error"]`` (NEXT_STEP: on a step that is neither terminated nor
truncated, the last episode's final observation and info kept) and is reset
again at its next step. ``close()`` closes every env whatever one of them
raises, then raises the first error.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from rl2gem.core import _PrivateLoop

__all__ = ["AsyncVectorEnv", "SyncVectorEnv", "VectorStep"]

VectorStep = tuple[list[str], np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]
_Slot = tuple[str, float, bool, bool, dict[str, Any]]


def _raise_first(errors: list[Exception]) -> None:
    """Raise the first of ``errors`` (the envs' close errors, all collected first), if any."""
    if errors:
        raise errors[0]


class _TextVectorEnv(gym.vector.VectorEnv):
    """Shared bookkeeping of the text vector envs (autoreset, errors, results)."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    ):
        if len(env_fns) == 0:
            raise ValueError("a vector env needs at least one env_fn")
        mode = AutoresetMode(autoreset_mode) if isinstance(autoreset_mode, str) else autoreset_mode
        if mode not in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
            raise ValueError(f"autoreset_mode must be NEXT_STEP or SAME_STEP, got {autoreset_mode!r}")
        self.metadata = {"autoreset_mode": mode}
        self._same_step = mode is AutoresetMode.SAME_STEP
        self.envs: list[gym.Env] = [fn() for fn in env_fns]
        self.num_envs = len(self.envs)
        first = self.envs[0]
        self.single_observation_space = first.observation_space
        self.single_action_space = first.action_space
        self.observation_space = batch_space(first.observation_space, self.num_envs)
        self.action_space = batch_space(first.action_space, self.num_envs)
        self.final_observations: list[str | None] = [None] * self.num_envs
        self.final_infos: list[dict[str, Any] | None] = [None] * self.num_envs
        self._needs_reset = [False] * self.num_envs  # lists: cheaper than numpy for scalar access
        self._was_reset = [False] * self.num_envs
        self.closed = False

    # -- argument handling
    def _indices(self, indices: Sequence[int] | None) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        out = [int(i) for i in indices]
        for i in out:
            if not 0 <= i < self.num_envs:
                raise IndexError(f"env index {i} out of range for {self.num_envs} envs")
        if len(set(out)) != len(out):
            raise ValueError(f"duplicate env indices in {out}")
        return out

    def _reset_args(self, seed, options, indices) -> list[tuple[int, int | None, dict | None]]:
        if isinstance(options, Mapping) and "reset_mask" in options:  # Gymnasium 1.x's partial reset
            mask = np.asarray(options["reset_mask"], dtype=bool)
            raise ValueError(
                "options['reset_mask'] is Gymnasium's partial reset; here pass the envs to reset as "
                f"indices={np.flatnonzero(mask).tolist()} (the result lists those envs only)"
            )
        idx = self._indices(indices)
        if seed is None:
            seeds: list[int | None] = [None] * len(idx)
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in idx]  # env i gets seed + i, also when reset alone
        else:
            seeds = list(seed)
            if len(seeds) != len(idx):
                raise ValueError(f"{len(seeds)} seeds for {len(idx)} envs")
        if options is None or isinstance(options, Mapping):
            opts = [options] * len(idx)
        else:
            opts = list(options)
            if len(opts) != len(idx):
                raise ValueError(f"{len(opts)} options for {len(idx)} envs")
        return list(zip(idx, seeds, opts, strict=True))

    def _step_args(self, actions: Sequence[Any] | Mapping[int, Any]) -> list[tuple[int, Any]]:
        if isinstance(actions, Mapping):
            pairs = list(actions.items())
            self._indices([i for i, _ in pairs])
        else:
            if isinstance(actions, (str, bytes)):
                raise TypeError("actions must be a sequence with one action per env or a {index: action} mapping")
            actions = list(actions)
            if len(actions) != self.num_envs:
                raise ValueError(f"{len(actions)} actions for {self.num_envs} envs; pass a mapping to step a subset")
            pairs = list(enumerate(actions))
        missing = [i for i, _ in pairs if not self._was_reset[i]]
        if missing:
            raise ResetNeeded(f"envs {missing} were never reset: call reset() first")
        return pairs

    # -- per-slot bookkeeping
    def _after_reset(self, i: int) -> None:
        self._was_reset[i] = True
        self._needs_reset[i] = False

    def _autoreset_slot(self, i: int, obs: str, info: dict[str, Any]) -> _Slot:
        """NEXT_STEP: the step after an episode ended only resets the env."""
        self._after_reset(i)
        info = dict(info)
        info["autoreset"] = True
        return obs, 0.0, False, False, info

    def _same_step_slot(self, i: int, final: _Slot, obs: str, info: dict[str, Any]) -> _Slot:
        """SAME_STEP: the finishing step returns the new episode's start, the end in info."""
        self._after_reset(i)
        info = dict(info)
        info["final_obs"], info["final_info"] = final[0], final[4]
        return obs, final[1], final[2], final[3], info

    @staticmethod
    def _autoreset_failed(e: BaseException) -> _Slot:
        """NEXT_STEP: the reset of an ended episode raised. No episode was stepped, so nothing is
        terminated or truncated and the last episode's final observation and info stay; the error
        is ``info["reset_error"]`` as in SAME_STEP, and the next step tries the reset again."""
        info = {"reset_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "autoreset": True}
        return "", 0.0, False, False, info

    def _reset_failed(self, slot: _Slot, e: BaseException) -> _Slot:
        slot[4]["reset_error"] = f"{type(e).__name__}: {e}"  # reset again at the next step
        return slot

    @staticmethod
    def _as_slot(result: tuple) -> _Slot:
        obs, reward, terminated, truncated, info = result
        return obs, float(reward), bool(terminated), bool(truncated), info

    @staticmethod
    def _error_slot(e: BaseException) -> _Slot:
        info = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        return "", 0.0, False, True, info

    def _record(self, i: int, slot: _Slot) -> _Slot:
        obs, _, terminated, truncated, info = slot
        if terminated or truncated:
            self._needs_reset[i] = True
            self.final_observations[i] = obs
            self.final_infos[i] = info
        return slot

    @staticmethod
    def _assemble(slots: list[_Slot]) -> VectorStep:
        return (
            [s[0] for s in slots],
            np.array([s[1] for s in slots], dtype=np.float32),
            np.array([s[2] for s in slots], dtype=bool),
            np.array([s[3] for s in slots], dtype=bool),
            [s[4] for s in slots],
        )

    def _sync_step_one(self, i: int, action: Any) -> _Slot:
        env = self.envs[i]
        if self._needs_reset[i]:
            try:
                return self._autoreset_slot(i, *env.reset())
            except Exception as e:
                return self._autoreset_failed(e)
        try:
            slot = self._record(i, self._as_slot(env.step(action)))
        except Exception as e:
            slot = self._record(i, self._error_slot(e))
        if self._same_step and (slot[2] or slot[3]):
            try:
                return self._same_step_slot(i, slot, *env.reset())
            except Exception as e:
                return self._reset_failed(slot, e)
        return slot

    def _sync_reset_one(self, i: int, seed: int | None, options: dict | None) -> tuple[str, dict]:
        obs, info = self.envs[i].reset(seed=seed, options=options)
        self._after_reset(i)
        return obs, info

    def close(self, **kwargs: Any) -> None:
        """Close every env, each whatever the others raised; the vector env is closed afterwards
        (a second call does nothing) and the first env's error is raised at the end."""
        if self.closed:
            return
        try:
            self.close_extras(**kwargs)
        finally:
            self.closed = True

    def close_extras(self, **kwargs: Any) -> None:
        errors = []
        for env in self.envs:
            try:
                env.close()
            except Exception as e:
                errors.append(e)
        _raise_first(errors)

    def __len__(self) -> int:
        return self.num_envs


class SyncVectorEnv(_TextVectorEnv):
    """Steps its envs one after another with their sync ``step`` (for debugging).

    Args:
        env_fns: callables returning the envs (mixed ids allowed).
        autoreset_mode: ``NEXT_STEP`` (default) or ``SAME_STEP`` (see the module doc).
    """

    def reset(self, *, seed=None, options=None, indices: Sequence[int] | None = None):
        """Reset the envs at ``indices`` (all by default).

        ``seed`` is ``None``, an int (env ``k`` gets ``seed + k``) or one seed
        per env; ``options`` one dict for all or one per env.

        Returns:
            ``(observations, infos)`` as lists over the reset envs.
        """
        out = [self._sync_reset_one(i, s, o) for i, s, o in self._reset_args(seed, options, indices)]
        return [o for o, _ in out], [inf for _, inf in out]

    def step(self, actions):
        return self._assemble([self._sync_step_one(i, a) for i, a in self._step_args(actions)])


class AsyncVectorEnv(_TextVectorEnv):
    """Steps its envs concurrently on an asyncio event loop.

    Args:
        env_fns: callables returning the envs (mixed ids allowed; envs without
            ``astep``, e.g. plain Gymnasium text envs, are treated as sync).
        max_concurrency: the most async-native envs awaited at once (``None``:
            all of them).
        sync_envs: how compute-only (sync) envs are run.
            ``"batched"`` (default): all sync envs of a vector step run one
            after another in a single worker-thread call (compute-only envs
            cannot run in parallel under the GIL anyway, so one thread hop per
            step is the cheapest way off the event loop). ``"threaded"``: one
            worker thread per env (up to ``max_concurrency`` or 64), for legacy
            sync envs that block on I/O.
        inline_below_s: with ``"batched"``, once 8 consecutive batches took
            less than this many seconds per env step on average, batches run
            directly on the event loop (a thread hop costs about 50-100 us,
            more than such steps). The first env step slower than
            ``20 * inline_below_s`` then sends batches back to the worker
            thread for good, so the loop is held at most by one unexpectedly
            slow step. ``0`` always uses the thread.
        autoreset_mode: ``NEXT_STEP`` (default) or ``SAME_STEP`` (see the module doc).

    Use ``await venv.areset()`` / ``await venv.astep(actions)`` inside a loop,
    or ``reset`` / ``step`` from sync code (they run on a private loop thread).
    """

    _INLINE_AFTER = 8

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        *,
        max_concurrency: int | None = None,
        sync_envs: str = "batched",
        inline_below_s: float = 1e-4,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    ):
        super().__init__(env_fns, autoreset_mode)
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
        if sync_envs not in ("batched", "threaded"):
            raise ValueError(f"sync_envs must be 'batched' or 'threaded', got {sync_envs!r}")
        self.max_concurrency = max_concurrency
        self.sync_envs = sync_envs
        self.inline_below_s = float(inline_below_s)
        # native: awaited on the loop. A Gymnasium wrapper (TimeLimit, RecordEpisodeStatistics...)
        # hides an async env's astep: such an env waits on I/O in its sync step, so it gets a
        # thread of its own, never the serial batch of compute-bound sync envs
        self._native = [
            bool(getattr(e, "is_async_native", False)) and callable(getattr(e, "astep", None)) for e in self.envs
        ]
        self._own_thread = [
            not native and bool(getattr(e.unwrapped, "is_async_native", False))
            for e, native in zip(self.envs, self._native, strict=True)
        ]
        self._fast_batches = 0  # consecutive batches whose every env step was fast
        self._inline_banned = self.inline_below_s <= 0 or sync_envs != "batched"
        self._executor: ThreadPoolExecutor | None = None
        self._loop: _PrivateLoop | None = None

    # -- sync facade
    def _run(self, coro):
        if self._loop is None:
            self._loop = _PrivateLoop(self)
        return self._loop.run(coro)

    def reset(self, *, seed=None, options=None, indices: Sequence[int] | None = None):
        """Sync twin of :meth:`areset`."""
        return self._run(self.areset(seed=seed, options=options, indices=indices))

    def step(self, actions):
        """Sync twin of :meth:`astep`."""
        return self._run(self.astep(actions))

    # -- running sync envs
    @property
    def runs_inline(self) -> bool:
        """Whether compute-only envs currently run directly on the event loop (see ``inline_below_s``)."""
        return not self._inline_banned and self._fast_batches >= self._INLINE_AFTER

    def _timed_batch(self, sync_calls: list, sync_fn) -> tuple[list, float, float]:
        out, slowest, start = [], 0.0, time.perf_counter()
        t0 = start
        for args in sync_calls:
            out.append((args[0], sync_fn(*args)))
            t1 = time.perf_counter()
            slowest, t0 = max(slowest, t1 - t0), t1
        return out, (t0 - start) / len(sync_calls), slowest

    async def _run_batch(self, sync_calls: list, sync_fn) -> list:
        if self.runs_inline:
            out, _, slowest = self._timed_batch(sync_calls, sync_fn)
            if slowest > 20 * self.inline_below_s:
                self._inline_banned = True
            return out
        out, mean, _ = await asyncio.get_running_loop().run_in_executor(None, self._timed_batch, sync_calls, sync_fn)
        self._fast_batches = self._fast_batches + 1 if mean < self.inline_below_s else 0
        return out

    async def _in_own_thread(self, fn, *args):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=min(self.max_concurrency or self.num_envs, 64), thread_name_prefix="rl2gem-venv"
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _gather(self, native_calls: list, sync_calls: list, sync_fn) -> dict[int, Any]:
        """Run native coroutines (bounded) and sync calls (batched or threaded; a hidden async
        env's always in a thread of its own) concurrently."""
        results: dict[int, Any] = {}
        own = [args for args in sync_calls if self._own_thread[args[0]]]
        sync_calls = [args for args in sync_calls if not self._own_thread[args[0]]]
        if not native_calls and not own and self.sync_envs == "batched":
            results.update(await self._run_batch(sync_calls, sync_fn) if sync_calls else ())
            return results
        sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None

        async def native(i, make_coro):
            if sem is None:
                results[i] = await make_coro()
            else:
                async with sem:
                    results[i] = await make_coro()

        async def batched():
            results.update(await self._run_batch(sync_calls, sync_fn))

        async def threaded(args):
            results[args[0]] = await self._in_own_thread(sync_fn, *args)

        tasks = [native(i, c) for i, c in native_calls] + [threaded(args) for args in own]
        if sync_calls:
            if self.sync_envs == "batched":
                tasks.append(batched())
            else:
                tasks.extend(threaded(a) for a in sync_calls)
        await asyncio.gather(*tasks)
        return results

    async def areset(self, *, seed=None, options=None, indices: Sequence[int] | None = None):
        """Reset the envs at ``indices`` (all by default), concurrently.

        ``seed`` is ``None``, an int (env ``k`` gets ``seed + k``) or one seed
        per env; ``options`` one dict for all or one per env.

        Returns:
            ``(observations, infos)`` as lists over the reset envs, in index order.

        Raises:
            whatever an env's reset raises (a reset failure is not hidden).
        """
        args = self._reset_args(seed, options, indices)

        def native_reset(i, s, o):
            async def run():
                obs, info = await self.envs[i].areset(seed=s, options=o)
                self._after_reset(i)
                return obs, info

            return run

        native = [(i, native_reset(i, s, o)) for i, s, o in args if self._native[i]]
        sync = [(i, s, o) for i, s, o in args if not self._native[i]]
        results = await self._gather(native, sync, self._sync_reset_one)
        ordered = [results[i] for i, _, _ in args]
        return [o for o, _ in ordered], [inf for _, inf in ordered]

    async def astep(self, actions) -> VectorStep:
        """Step the envs named by ``actions`` concurrently (see the module doc)."""
        pairs = self._step_args(actions)

        def native_step(i, action):
            async def run() -> _Slot:
                env = self.envs[i]
                if self._needs_reset[i]:
                    try:
                        return self._autoreset_slot(i, *await env.areset())
                    except Exception as e:
                        return self._autoreset_failed(e)
                try:
                    slot = self._record(i, self._as_slot(await env.astep(action)))
                except Exception as e:
                    slot = self._record(i, self._error_slot(e))
                if self._same_step and (slot[2] or slot[3]):
                    try:
                        return self._same_step_slot(i, slot, *await env.areset())
                    except Exception as e:
                        return self._reset_failed(slot, e)
                return slot

            return run

        native = [(i, native_step(i, a)) for i, a in pairs if self._native[i]]
        sync = [(i, a) for i, a in pairs if not self._native[i]]
        results = await self._gather(native, sync, self._sync_step_one)
        return self._assemble([results[i] for i, _ in pairs])

    async def aclose(self) -> None:
        """Close every env from the running loop (async envs release their sessions there)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._close_envs_async()
        finally:
            self._shutdown()

    def close_extras(self, **kwargs: Any) -> None:
        try:
            if self._loop is not None:
                self._loop.run(self._close_envs_async())
            else:
                super().close_extras(**kwargs)
        finally:
            self._shutdown()

    async def _close_envs_async(self) -> None:
        errors = []
        for env in self.envs:
            try:
                if hasattr(env, "aclose"):
                    await env.aclose()
                else:
                    env.close()
            except Exception as e:
                errors.append(e)
        _raise_first(errors)

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
