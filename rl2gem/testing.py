"""Conformance checks for rl2gem environments.

:func:`check_env` runs Gymnasium's own :func:`gymnasium.utils.env_checker.check_env`
and then the checks a text env for LLM training needs on top of it. The test
suite runs it over every registered id, so a new env is checked the day it is
registered.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import pickle
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env as gym_check_env

from rl2gem.aio import run_coroutine
from rl2gem.core import VALID_ROLES, Env
from rl2gem.env_protocol import ACTION_FIELD
from rl2gem.remote import RemoteEnv

__all__ = ["check_env", "check_server", "PROBE_ACTIONS", "scripted_actions"]

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
    return [(obs, _stable(info)), *_go_on(env, actions)]


#: why a step of a scripted episode must not raise
NEVER_RAISE = "answer an action the env cannot use with self.invalid_action(reason, feedback); never raise on one"


def _go_on(env: gym.Env, actions: list[Any], why: str = NEVER_RAISE) -> list[tuple]:
    """The steps of ``actions`` until the episode ends.

    Raises:
        AssertionError: a step raised (``why`` says what the env must do).
    """
    out: list[tuple] = []
    for a in actions:
        try:
            result = env.step(a)
        except Exception as e:
            raise AssertionError(f"{env.unwrapped!r}: step({a!r:.60}) raised {type(e).__name__}: {e} ({why})") from e
        step = _stable_step(result)
        out.append(step)
        if step[2] or step[3]:
            break
    return out


async def _aplay(env: gym.Env, seed: int, actions: list[Any]) -> list[tuple]:
    obs, info = await env.areset(seed=seed)  # type: ignore[attr-defined]
    out: list[tuple] = [(obs, _stable(info))]
    for a in actions:
        step = _stable_step(await env.astep(a))
        out.append(step)
        if step[2] or step[3]:
            break
    return out


#: a hook call at least this long (seconds) in which the event loop got no turn blocked it
BLOCKING_CALL_S = 0.1


async def _aplay_watched(env: gym.Env, seed: int, actions: list[Any]) -> tuple[list[tuple], int, int]:
    """:func:`_aplay`, with a task that wakes every 5 ms beside it: ``(episode, blocking calls,
    calls)``. A call of ``areset``/``astep`` blocked when it took :data:`BLOCKING_CALL_S` or more
    and that task woke at most once during it (an awaiting call lets it wake every 5 ms)."""
    wakes = 0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal wakes
        while not done.is_set():
            await asyncio.sleep(0.005)
            wakes += 1

    async def watched(call):
        nonlocal blocking
        start, woken = time.perf_counter(), wakes
        result = await call
        blocking += time.perf_counter() - start >= BLOCKING_CALL_S and wakes - woken <= 1
        return result

    blocking = 0
    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker starts first
    try:
        obs, info = await watched(env.areset(seed=seed))  # type: ignore[attr-defined]
        out: list[tuple] = [(obs, _stable(info))]
        for a in actions:
            step = _stable_step(await watched(env.astep(a)))  # type: ignore[attr-defined]
            out.append(step)
            if step[2] or step[3]:
                break
    finally:
        done.set()
        await ticker
        closer = getattr(env.unwrapped, "aclose_loop", None)  # a RemoteEnv's session of this loop
        if closer is not None:
            await closer()
    return out, blocking, len(out)


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
    env: gym.Env | str,
    *,
    num_steps: int = 8,
    seed: int = 7,
    make: Callable[[], gym.Env] | None = None,
    copies: bool = True,
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
       ``reset``/``step`` give; an async-native env's hooks do not block the
       event loop (a call of :data:`BLOCKING_CALL_S` or more in which the loop
       got no turn, in two calls or more and half of them, in the episode and
       in two plays of it again).
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
    9. Copies (``copies=True``, envs other than a :class:`rl2gem.remote.RemoteEnv`): a
       ``copy.deepcopy`` and a ``pickle`` round trip, taken after the first step (after the
       reset in a one-step episode), go on as the original does: the deep copy before the
       original, which still does after the copy is closed, the pickled one after its original
       is closed (:mod:`rl2gem.core`, "Copies").

    Args:
        env: an env, a registered id, or the URL of an env server
            (``python -m rl2gem.envserver``): then :func:`check_server` first,
            and every check above on :class:`rl2gem.remote.RemoteEnv` clients.
            With an id, fresh envs come from ``gymnasium.make(id)``; with an
            env, from ``make`` if given, else from ``env.clone()``.
        num_steps: actions per scripted episode.
        seed: seed of the scripted episodes.
        copies: run check 9 (turn it off for an env that holds what cannot be copied).

    Raises:
        AssertionError: naming the first check that failed.
    """
    created = isinstance(env, str)
    if isinstance(env, str) and env.startswith(("http://", "https://")):
        url = env
        check_server(url, num_steps=num_steps, seed=seed)
        make = make or (lambda: RemoteEnv(url))
        env = make()
    elif isinstance(env, str):
        env_id = env
        make = make or (lambda: gym.make(env_id))
        env = make()
    elif make is None:
        make = env.unwrapped.clone  # type: ignore[attr-defined]
    assert make is not None
    try:
        _check_made_env(env, make, num_steps, seed)
        if copies and not isinstance(env.unwrapped, RemoteEnv):
            _check_copies(make, repr(env.unwrapped), scripted_actions(env, num_steps, seed), seed)
    finally:
        if created:  # the env check_env made (a served env's session ends with it)
            env.close()


def _check_made_env(env: gym.Env, make: Callable[[], gym.Env], num_steps: int, seed: int) -> None:
    """The checks of :func:`check_env` on ``env``, with fresh envs from ``make``."""
    base = env.unwrapped
    name = repr(base)
    assert isinstance(base, Env), f"{name}: not an rl2gem.Env"
    assert isinstance(env.observation_space, gym.spaces.Text), f"{name}: observation_space is not a Text space"
    assert isinstance(env.action_space, gym.spaces.Text), f"{name}: action_space is not a Text space"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gym_check_env(base, skip_render_check=base.spec is None)
        except AssertionError:
            raise
        except Exception as e:  # it resets and steps random text actions
            raise AssertionError(
                f"{name}: Gymnasium's env checker: {type(e).__name__}: {e} (it plays random text: answer an action "
                "the env cannot use with self.invalid_action(reason, feedback); never raise on one)"
            ) from e
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
        ta, blocking, calls = run_coroutine(_aplay_watched(b, seed, actions))
        # two calls or more, and half of them, in two plays: a machine busy with other work can
        # stretch a short computing call past the limit, now and then, not all the time
        replays = 2
        while base.is_async_native and blocking >= 2 and blocking * 2 >= calls and replays:
            replays -= 1
            _, blocking, calls = run_coroutine(_aplay_watched(b, seed, actions))
        assert not (base.is_async_native and blocking >= 2 and blocking * 2 >= calls), (
            f"{name}: {blocking} of {calls} areset/astep calls blocked the event loop for "
            f"{BLOCKING_CALL_S} s or more: a blocking call in _areset/_astep (await the I/O, or run "
            "it with asyncio.to_thread)"
        )
        if deterministic:
            assert _same(ts, ta), f"{name}: areset/astep disagree with reset/step"
        for rec in ts[1:] + ta[1:]:
            assert rec[4].get("role") in VALID_ROLES, f"{name}: info['role'] = {rec[4].get('role')!r}" + (
                "; an env that overrides step() skips rl2gem.Env's info defaults: override _step"
                if "role" not in rec[4]
                else ""
            )
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


def _check_copies(make: Callable[[], gym.Env], name: str, actions: list[str], seed: int) -> None:
    """Check 9 of :func:`check_env`."""
    whole = make()
    try:
        reference = _play(whole, seed, actions)
        deterministic = whole.unwrapped.spec is None or not whole.unwrapped.spec.nondeterministic
    finally:
        whole.close()
    split = 1 if len(reference) > 2 else 0  # steps the original takes before it is copied
    rest = actions[split : len(reference) - 1]
    # the deep copy goes on, is closed, then the original goes on; the pickled copy goes on after
    # its original is closed (what the original holds must not be what the copy runs on)
    for how, duplicate in (("copy.deepcopy", copy.deepcopy), ("pickle", lambda e: pickle.loads(pickle.dumps(e)))):
        original = make()
        after = None
        try:
            _play(original, seed, actions[:split])
            try:
                twin = duplicate(original)
            except Exception as e:
                raise AssertionError(f"{name}: {how} of an env in an episode raised {type(e).__name__}: {e}") from e
            try:
                if how == "pickle":
                    original.close()
                closed = ", after its original was closed" if how == "pickle" else ""
                branch = _go_on(twin, rest, f"in a copy by {how}{closed}: what a copy runs on must be its own")
            finally:
                twin.close()
            if how != "pickle":
                after = _go_on(original, rest)  # the copy is closed: the original goes on
        finally:
            original.close()
        if deterministic:
            assert _same(branch, reference[split + 1 :]), f"{name}: a copy ({how}) went on otherwise than the original"
            assert after is None or _same(after, reference[split + 1 :]), (
                f"{name}: the original went on otherwise after its copy ({how})"
            )


def _stable_step(result: tuple) -> tuple:
    obs, reward, terminated, truncated, info = result
    return obs, reward, terminated, truncated, _stable(info)


def _http(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON body) of one call; a body that is not JSON reads as None."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read()
    try:
        return status, json.loads(text or b"null")
    except ValueError:
        return status, None


def _check_routes(url: str) -> None:
    """The fixed routes, as ``openenv validate`` checks them."""
    assert _http(f"{url}/health") == (200, {"status": "healthy"}), f"{url}: /health is not 200 healthy"
    status, metadata = _http(f"{url}/metadata")
    assert status == 200 and all(isinstance(metadata.get(k), str) for k in ("name", "description")), (
        f"{url}: /metadata lacks name and description strings"
    )
    status, schema = _http(f"{url}/schema")
    assert status == 200 and all(isinstance(schema.get(k), dict) for k in ("action", "observation", "state")), (
        f"{url}: /schema lacks the action, observation and state schemas"
    )
    assert schema["action"].get("required") == [ACTION_FIELD], (
        f"{url}: the action schema does not require {ACTION_FIELD!r}"
    )
    status, openapi = _http(f"{url}/openapi.json")
    assert status == 200 and str(openapi.get("info", {}).get("version", "")).startswith("1."), (
        f"{url}: /openapi.json has no 1.x info.version"
    )
    assert {"/reset", "/step", "/state"} <= set(openapi.get("paths", {})), (
        f"{url}: /openapi.json lacks the episode routes"
    )
    status, reply = _http(f"{url}/mcp", "POST", {})
    assert status == 200 and reply.get("jsonrpc") == "2.0", f"{url}: /mcp is not JSON-RPC 2.0"


def _check_refusals(url: str, seed: int) -> None:
    """Bad requests get a 4xx with an error body, and the session they aimed at goes on."""
    status, envelope = _http(f"{url}/reset", "POST", {"seed": seed})
    assert status == 200 and isinstance(envelope.get("session_id"), str), f"{url}: /reset opened no session"
    observation = envelope.get("observation", {})
    assert isinstance(observation.get(ACTION_FIELD), str) and isinstance(observation.get("info"), dict), (
        f"{url}: /reset's observation is not {{{ACTION_FIELD}, terminated, truncated, info}}"
    )
    assert envelope.get("done") is False and envelope.get("reward") is None, f"{url}: /reset's envelope is off"
    session = envelope["session_id"]
    for path, body, raw, status in [
        ("/step", None, b"{not json", 400),
        ("/step", {"session_id": "no-such-session", "action": {ACTION_FIELD: "x"}}, None, 404),
        ("/step", {"session_id": session}, None, 400),
        ("/step", {"session_id": session, "action": {ACTION_FIELD: 5}}, None, 422),
        ("/reset", {"seed": -1}, None, 422),
    ]:
        got, answer = _http(url + path, "POST", body, raw)
        assert got == status and isinstance(answer, dict) and isinstance(answer.get("detail"), str), (
            f"{url}: POST {path} {body or raw!r:.60} answered {got} {answer!r:.100}, expected {status} with a detail"
        )
    status, state = _http(f"{url}/state?session_id={session}")
    assert status == 200 and state.get("step_count") == 0, f"{url}: a refused request changed the session"
    _http(f"{url}/close", "POST", {"session_id": session})


def check_server(url: str, *, num_steps: int = 8, seed: int = 7) -> None:
    """Check a running env server against the contract of :mod:`rl2gem.serving.env_server`.

    1. The fixed routes, as ``openenv validate`` checks them: ``/health``, ``/metadata``,
       ``/schema`` (action, observation and state schemas; the action requires its text field),
       ``/openapi.json`` (``info.version`` 1.x, the episode routes), ``/mcp`` (JSON-RPC 2.0).
    2. A reset's envelope; bad requests (not JSON, an unknown session, no action, an action that
       is not text, a negative seed) get the 4xx they should with a ``detail``, and the session
       is untouched.
    3. Sessions are isolated: two episodes played step by step in turn equal each played alone.

    Raises:
        AssertionError: naming the first check that failed.
    """
    url = url.rstrip("/")
    _check_routes(url)
    _check_refusals(url, seed)
    first, second, alone = RemoteEnv(url), RemoteEnv(url), RemoteEnv(url)
    try:
        actions = scripted_actions(first, num_steps, seed)
        solo = [_play(alone, seed, actions), _play(alone, seed + 1, actions)]
        together: list[list[tuple]] = [
            [_stable_reset(env.reset(seed=s))] for env, s in ((first, seed), (second, seed + 1))
        ]
        live = [True, True]
        for action in actions:
            for k, env in enumerate((first, second)):
                if live[k]:
                    obs, r, term, trunc, info = env.step(action)
                    together[k].append((obs, r, term, trunc, _stable(info)))
                    live[k] = not (term or trunc)
        assert _same(together, solo), f"{url}: two sessions played in turn differ from each played alone"
    finally:
        for env in (first, second, alone):
            env.close()


def _stable_reset(result: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    return result[0], _stable(result[1])
