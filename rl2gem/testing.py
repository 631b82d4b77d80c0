"""Conformance checks for rl2gem environments.

:func:`check_env` runs Gymnasium's own :func:`gymnasium.utils.env_checker.check_env`
and then the checks a text env for LLM training needs on top of it. The test
suite runs it over every registered id, so a new env is checked the day it is
registered.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env as gym_check_env

from rl2gem.core import VALID_ROLES, Env

__all__ = ["check_env", "PROBE_ACTIONS", "scripted_actions"]

#: Odd actions every env must survive without raising (besides an over-long
#: one built from the env's own limit). The first seven must be reported as
#: invalid; the rest are valid text an env may or may not accept.
PROBE_ACTIONS: tuple[Any, ...] = (
    "",
    "   \n\t ",
    b"\xff\xfe\xfa garbage",
    "\ud800 lone surrogate",
    None,
    12345,
    ["a", "list"],
    "<answer></answer><answer>",
    "\\boxed{",
    "\x00\x01\x02",
    "ünïcödé 数学 🙂 \u200b",
    "}" * 50 + "{" * 50,
)


def scripted_actions(env: gym.Env, n: int, seed: int = 0) -> list[str]:
    """``n`` actions for ``env``: its ``sample_random_action()`` if it has one
    (games do: actions in the game's format), else samples of its action space."""
    sampler = getattr(env.unwrapped, "sample_random_action", None)
    if callable(sampler):
        if "rng" in inspect.signature(sampler).parameters:
            rng = np.random.default_rng(seed)
            return [sampler(rng=rng) for _ in range(n)]
        return [sampler() for _ in range(n)]
    env.action_space.seed(seed)
    return [env.action_space.sample() for _ in range(n)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


_VOLATILE_INFO = ("elapsed", "latency", "time", "traceback")


def _stable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if not any(t in k for t in _VOLATILE_INFO)}


def _play(env: gym.Env, seed: int, actions: list[Any]) -> list[tuple]:
    obs, info = env.reset(seed=seed)
    out: list[tuple] = [(obs, _stable(info))]
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        out.append((obs, r, term, trunc, _stable(info)))
        if term or trunc:
            break
    return out


async def _aplay(env: gym.Env, seed: int, actions: list[Any]) -> list[tuple]:
    obs, info = await env.areset(seed=seed)  # type: ignore[attr-defined]
    out: list[tuple] = [(obs, _stable(info))]
    for a in actions:
        obs, r, term, trunc, info = await env.astep(a)  # type: ignore[attr-defined]
        out.append((obs, r, term, trunc, _stable(info)))
        if term or trunc:
            break
    return out


def _check_tool_conventions(name: str, episode: list[tuple]) -> None:
    tools = episode[0][1].get("tools")
    if tools is not None:
        assert isinstance(tools, list), f"{name}: info['tools'] is not a list"
        for t in tools:
            fn = t.get("function") if isinstance(t, dict) else None
            assert (
                t.get("type") == "function"
                and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)
                and isinstance(fn.get("parameters", {}), dict)
            ), f"{name}: info['tools'] has a non-function schema {t!r:.80}"
    for obs, _r, _term, _trunc, info in episode[1:]:
        results = info.get("tool_results")
        if results is None:
            continue
        assert info.get("role") == "tool", f"{name}: info['tool_results'] on a step whose role is {info.get('role')!r}"
        assert isinstance(results, list) and results and all(isinstance(x, str) for x in results), (
            f"{name}: info['tool_results'] is not a non-empty list of strings"
        )
        assert all(x in obs for x in results), f"{name}: a tool result is missing from the observation"


def check_env(
    env: gym.Env | str, *, num_steps: int = 8, seed: int = 7, make: Callable[[], gym.Env] | None = None
) -> None:
    """Check that a text env follows Gymnasium's API and rl2gem's contract.

    Checks, in order:

    1. Gymnasium's ``check_env`` (spaces, seeding, step determinism, returned
       data not reused, render modes, close twice).
    2. The spaces are :class:`gymnasium.spaces.Text`.
    3. Seed determinism over a whole episode: two fresh envs reset with the
       same seed and fed the same ``num_steps`` actions give identical
       observations, rewards, flags and infos; ``reset(seed=info["seed"])``
       replays an unseeded episode's initial state.
    4. Async/sync agreement: ``areset``/``astep`` give exactly what
       ``reset``/``step`` give.
    5. ``spawn(n)`` gives ``n`` envs in the same initial state.
    6. Invalid-action robustness: each of :data:`PROBE_ACTIONS` and an
       over-long action returns a valid step (``str`` observation in the
       observation space, ``float`` reward, ``info["role"]`` valid) without
       raising, and type/encoding/emptiness/length errors are reported in
       ``info["invalid_action"]``.
    7. ``close()`` twice.
    8. Tool conventions, for envs that offer tools: the reset ``info["tools"]``
       is a list of OpenAI-style function schemas (``{"type": "function",
       "function": {"name", "parameters"}}``), and a step's
       ``info["tool_results"]`` is a non-empty list of strings, each in the
       observation, on a ``role="tool"`` step.

    Args:
        env: an env or a registered id. With an id, fresh envs come from
            ``gymnasium.make(id)``; with an env, from ``make`` if given, else
            from ``env.clone()``.
        num_steps: actions per scripted episode.
        seed: seed of the scripted episodes.

    Raises:
        AssertionError: naming the first check that failed.
    """
    if isinstance(env, str):
        env_id = env
        make = make or (lambda: gym.make(env_id))
        env = make()
    elif make is None:
        make = env.unwrapped.clone  # type: ignore[attr-defined]
    assert make is not None
    base = env.unwrapped
    name = repr(base)
    assert isinstance(base, Env), f"{name}: not an rl2gem.Env"
    assert isinstance(env.observation_space, gym.spaces.Text), f"{name}: observation_space is not a Text space"
    assert isinstance(env.action_space, gym.spaces.Text), f"{name}: action_space is not a Text space"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gym_check_env(base, skip_render_check=base.spec is None)
    deterministic = base.spec is None or not base.spec.nondeterministic

    actions = scripted_actions(env, num_steps, seed)

    # 3. determinism across fresh instances
    a, b = make(), make()
    try:
        if deterministic:
            ta, tb = _play(a, seed, actions), _play(b, seed, actions)
            assert _same(ta, tb), f"{name}: same seed and actions gave different episodes"
            obs_random, info_random = a.reset()
            obs_replay, _ = b.reset(seed=info_random["seed"])
            assert obs_random == obs_replay, f"{name}: reset(seed=info['seed']) does not replay the initial state"
        # 4. async/sync agreement
        ts = _play(a, seed, actions)
        ta = asyncio.run(_aplay(b, seed, actions))
        if deterministic:
            assert _same(ts, ta), f"{name}: areset/astep disagree with reset/step"
        for rec in ts[1:] + ta[1:]:
            assert rec[4]["role"] in VALID_ROLES, f"{name}: info['role'] = {rec[4]['role']!r}"
        _check_tool_conventions(name, ts)
        # 5. spawn
        obs0, _ = a.reset(seed=seed)
        spawn = a.spawn if hasattr(a, "spawn") else a.unwrapped.spawn  # type: ignore[attr-defined]
        envs, observations, infos = spawn(3)  # wrappers (e.g. tools) re-wrap their copies
        try:
            assert len(envs) == 3 and all(o == obs0 for o in observations), f"{name}: spawn gave other initial states"
            assert all(i["seed"] == seed for i in infos), f"{name}: spawned envs report another seed"
        finally:
            for e in envs:
                e.close()
        # 6. invalid actions
        limit = getattr(env.action_space, "max_length", 1 << 16)
        bad = list(PROBE_ACTIONS) + ["x" * (limit + 1)]
        must_flag = set(range(7)) | {len(bad) - 1}
        for k, action in enumerate(bad):
            a.reset(seed=seed + k)
            try:
                obs, r, term, trunc, info = a.step(action)
            except Exception as e:
                raise AssertionError(f"{name}: step({action!r:.40}) raised {type(e).__name__}: {e}") from e
            assert isinstance(obs, str) and obs in env.observation_space, f"{name}: bad observation for {action!r:.40}"
            assert isinstance(r, float) and isinstance(term, bool) and isinstance(trunc, bool)
            assert info.get("role") in VALID_ROLES
            if k in must_flag:
                assert info.get("invalid_action"), (
                    f"{name}: step({action!r:.40}) not reported in info['invalid_action']"
                )
                assert info.get("num_invalid_actions", 0) >= 1
    finally:
        a.close()
        b.close()
    # 7. close twice
    c = make()
    c.reset(seed=seed)
    c.close()
    c.close()
