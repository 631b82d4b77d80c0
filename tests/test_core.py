"""The Env contract: seeding, async twins, invalid actions, order, limits."""

import asyncio
import functools
import gc
import os
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.error import ResetNeeded
from gymnasium.spaces.utils import flatten, flatten_space, unflatten
from toy_envs import CountEnv, SlowSearchEnv, UnicodeEchoEnv

import rl2gem
from rl2gem import AsyncVectorEnv, Env, TextSpace
from rl2gem.core import TEXT_PADDING, SharedTexts, Wrapper, _PrivateLoop


def test_text_space_membership():
    space = TextSpace(5)
    assert isinstance(space, gym.spaces.Text)
    assert "héllo" in space and "" in space
    assert "toolong" not in space
    assert "\ud800" not in space  # lone surrogate: not UTF-8 encodable
    assert b"abc" not in space and 3 not in space
    space.seed(0)
    samples = [space.sample() for _ in range(50)]
    assert all(s in space for s in samples)


@pytest.mark.parametrize("text", ["", "abc", "é 数学 🙂\n\t\x00", "z" * 12])
def test_text_flattens_to_its_code_points_and_back(text):
    space = TextSpace(12)
    flat = flatten(space, text)
    assert flat.dtype == np.int32 and flat.shape == (12,) and flat in flatten_space(space)
    assert flat[: len(text)].tolist() == [ord(c) for c in text] and (flat[len(text) :] == TEXT_PADDING).all()
    assert unflatten(space, flat) == text


@pytest.mark.parametrize("make", [UnicodeEchoEnv, lambda: gym.make("rl2/GuessTheNumber-v0")], ids=["unicode", "guess"])
def test_gymnasiums_process_vector_env_gives_the_sync_ones_text_observations(make):
    """``gymnasium.vector.AsyncVectorEnv`` (``gym.make_vec(..., vectorization_mode="async")``) passes
    observations through shared memory by default; Gymnasium read a ``Text`` space's once, at the
    start, so every observation came back blank, and characters outside ``Text``'s set failed."""
    actions = [("12", "é"), ("🙂", ""), ("\\boxed{25}", "\\boxed{40}")]
    episodes = []
    for vector in (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv):
        envs = vector([make, make])
        try:
            steps = [envs.reset(seed=7)[0]] + [envs.step(list(a))[0] for a in actions]
        finally:
            envs.close()
        assert all(type(obs) is tuple and all(isinstance(o, str) and o for o in obs) for obs in steps)
        episodes.append(steps)
    assert episodes[0] == episodes[1]
    live = gym.vector.AsyncVectorEnv([make], copy=False)  # the shared memory itself: read when indexed
    try:
        first = live.reset(seed=7)[0]
        assert isinstance(first, SharedTexts) and first == episodes[0][0][:1]
        live.step(["12"])
        assert first[0] == episodes[0][1][0]
    finally:
        live.close()


def test_shared_texts_behave_as_the_tuple_of_their_strings():
    """A vector env's live text observations (``copy=False``) index, compare, order and
    concatenate as the tuple of their strings, which ``deepcopy`` and ``pickle`` give."""
    import copy
    import pickle

    from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

    space = TextSpace(8)
    memory = create_shared_memory(space, n=2)
    for index, text in enumerate(["a", "b"]):
        write_to_shared_memory(space, index, text, memory)
    live, same = read_from_shared_memory(space, memory, n=2), ("a", "b")
    assert live == same and same == live and live == read_from_shared_memory(space, memory, n=2)
    for other in ("ab", ["a", "b"], ("a",)):  # not a tuple's equal either
        assert (live == other) is (same == other) is False and live != other
    assert (live < ("b",), live >= ("a",), live > same, live <= same) == (True, True, False, True)
    assert live + ("c",) == ("a", "b", "c") and ("c",) + live == ("c", "a", "b")
    assert (live[True], live[-1], live[np.int64(0)], live[:1]) == ("b", "b", "a", ("a",))
    for index in ([0, 1], np.array([True, True])):  # a tuple refuses them: no joined strings
        with pytest.raises(TypeError):
            live[index]
    for kept in (copy.deepcopy(live), pickle.loads(pickle.dumps(live))):
        assert type(kept) is tuple and kept == same
    write_to_shared_memory(space, 0, "z", memory)
    assert live == ("z", "b") and kept == same  # the view is live, the copies are not


def test_reset_returns_seed_and_role_and_is_deterministic():
    a, b = CountEnv(), CountEnv()
    obs_a, info_a = a.reset(seed=11)
    obs_b, info_b = b.reset(seed=11)
    assert obs_a == obs_b and info_a == info_b
    assert info_a["seed"] == 11 and info_a["role"] == "user"


def test_unseeded_reset_is_replayable_from_info_seed():
    env = CountEnv()
    env.reset(seed=3)
    goals, seeds = [], []
    for _ in range(20):
        _, info = env.reset()
        goals.append(info["goal"])
        seeds.append(info["seed"])
    replay = CountEnv()
    assert [replay.reset(seed=s)[1]["goal"] for s in seeds] == goals
    # a seeded reset followed by unseeded ones is itself reproducible
    again = CountEnv()
    again.reset(seed=3)
    assert [again.reset()[1]["seed"] for _ in range(20)] == seeds


def test_spawn_gives_same_initial_state():
    env = CountEnv()
    obs, info = env.reset(seed=5)
    envs, observations, infos = env.spawn(4)
    assert len(envs) == 4 and observations == [obs] * 4
    assert all(i["goal"] == info["goal"] for i in infos)
    assert len({id(e) for e in envs} | {id(env)}) == 5
    with pytest.raises(ResetNeeded):
        CountEnv().spawn(2)
    with pytest.raises(ValueError):
        env.spawn(0)


def test_order_is_enforced():
    env = CountEnv()
    with pytest.raises(ResetNeeded):
        env.step("1")
    env.reset(seed=0)
    for k in range(1, env.goal + 1):
        obs, r, term, trunc, info = env.step(str(k))
    assert term and r == 1.0
    with pytest.raises(ResetNeeded):
        env.step("1")


@pytest.mark.parametrize(
    "action, reason",
    [
        ("", "empty"),
        ("  \n", "empty"),
        (None, "must be text, got NoneType"),
        (42, "must be text, got int"),
        (b"\xff\xfe", "not valid UTF-8"),
        ("\udc80", "not valid UTF-8"),
        ("9" * 40_000, "the limit is"),
    ],
)
def test_invalid_actions_never_raise(action, reason):
    env = CountEnv()
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(action)
    assert reason in info["invalid_action"]
    assert info["num_invalid_actions"] == 1 and r == 0.0 and not term and not trunc
    assert obs.startswith("Invalid action") and obs in env.observation_space
    # the episode goes on, and the counter accumulates
    _, _, _, _, info = env.step("not a number")
    assert info["invalid_action"] == "not a number" and info["num_invalid_actions"] == 2
    _, _, _, _, info = env.step("1")
    assert info["invalid_action"] is None and info["num_invalid_actions"] == 2


def test_bytes_action_is_decoded():
    env = CountEnv()
    env.reset(seed=0)
    obs, *_, info = env.step(b"1")
    assert obs == "Next." and info["invalid_action"] is None


def test_max_turns_truncates():
    env = CountEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step("7")[3] is False
    obs, r, term, trunc, info = env.step("7")
    assert trunc and not term and info["truncated_reason"] == "max_turns" and info["turn"] == 2


def test_long_observation_is_cut_to_space():
    class Loud(CountEnv):
        observation_space = TextSpace(100)

        def _step(self, action):
            return "x" * 1000, 0.0, False, False, {}

    env = Loud()
    env.reset(seed=0)
    obs = env.step("1")[0]
    assert len(obs) == 100 and obs.endswith("truncated]") and obs in env.observation_space


def test_role_must_be_valid():
    class BadRole(CountEnv):
        def _step(self, action):
            return "x", 0.0, False, False, {"role": "assistant"}

    env = BadRole()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="role"):
        env.step("1")


def test_hooks_must_be_implemented_consistently():
    class Nothing(Env):
        pass

    class Half(Env):
        async def _astep(self, action):
            return "", 0.0, True, False, {}

        def _reset(self, options):
            return "", {}

    with pytest.raises(TypeError, match="neither"):
        Nothing().reset()
    with pytest.raises(TypeError, match="both"):
        Half().reset()


class ReturnsThis(CountEnv):
    """A step hook that returns the class attribute ``result``."""

    result: tuple = ()

    def _step(self, action):
        return self.result


@pytest.mark.parametrize(
    "result, error, message",
    [
        (("x", "1.0", False, False, {}), TypeError, r"reward '1.0' \(str\); it must be a float"),
        (("x", None, False, False, {}), TypeError, r"reward None \(NoneType\)"),
        (("x", np.array([1.0]), False, False, {}), TypeError, r"\(ndarray\); it must be a float"),
        (("x", float("nan"), False, False, {}), ValueError, "reward nan; it must be finite"),
        (("x", 1.0, "False", False, {}), TypeError, r"terminated='False' \(str\); it must be a bool"),
        (("x", 1.0, False, 0, {}), TypeError, r"truncated=0 \(int\)"),
        (("x", 1.0, False, False, None), TypeError, "step hook returned info None; it must be a dict"),
    ],
)
def test_a_step_hook_returning_wrong_types_is_named(result, error, message):
    env = type("Bad", (ReturnsThis,), {"result": result})()
    env.reset(seed=0)
    with pytest.raises(error, match=message) as caught:
        env.step("1")
    assert str(caught.value).startswith("Bad step hook returned")


@pytest.mark.parametrize(
    "reward, expected",
    [(np.float32(0.5), 0.5), (np.bool_(True), 1.0), (np.array(0.25), 0.25), (torch.tensor(2.0), 2.0), (3, 3.0)],
)
def test_numpy_and_torch_rewards_and_flags_are_plain_python_after_the_step(reward, expected):
    env = type("Numpy", (ReturnsThis,), {"result": ("x", reward, np.bool_(True), False, {})})()
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step("1")
    assert (type(reward), reward, type(terminated), terminated, truncated) == (float, expected, bool, True, False)


def test_a_reset_hook_returning_wrong_shapes_is_named():
    class ObservationOnly(CountEnv):
        def _reset(self, options):
            return "the task"

    class NoInfo(CountEnv):
        def _reset(self, options):
            return "the task", None

    with pytest.raises(
        TypeError, match=r"ObservationOnly reset hook must return \(observation, info\), got 'the task'"
    ):
        ObservationOnly().reset(seed=0)
    with pytest.raises(TypeError, match="NoInfo reset hook returned info None; it must be a dict"):
        NoInfo().reset(seed=0)


def test_a_hook_of_the_wrong_kind_is_named():
    class AsyncStep(CountEnv):
        async def _step(self, action):
            return "", 0.0, True, False, {}

    class PlainAsyncHooks(Env):
        def _areset(self, options):
            return "", {}

        async def _astep(self, action):
            return "", 0.0, True, False, {}

    with pytest.raises(TypeError, match="AsyncStep._step must be a plain def.*rename it _astep"):
        AsyncStep().reset(seed=0)

    def logged(hook):  # a plain decorator around a coroutine hook: still the coroutine hook
        @functools.wraps(hook)
        def call(*args):
            return hook(*args)

        return call

    class Decorated(Env):
        @logged
        async def _areset(self, options):
            return "", {}

        @logged
        async def _astep(self, action):
            return "", 1.0, True, False, {}

    env = Decorated()
    env.reset(seed=0)
    assert env.step("x")[1] == 1.0
    with pytest.raises(TypeError, match="PlainAsyncHooks._areset must be an async def.*rename it _reset"):
        PlainAsyncHooks().reset(seed=0)


def test_compute_env_async_runs_off_the_event_loop():
    env = CountEnv()

    async def main():
        loop_thread = threading.get_ident()
        await env.areset(seed=1)
        await env.astep("1")
        return loop_thread

    loop_thread = asyncio.run(main())
    assert env.step_threads and loop_thread not in env.step_threads


def test_async_env_sync_api_works_inside_a_running_loop():
    env = SlowSearchEnv(latency=0.001)

    async def main():
        # a sync call from inside a loop must not deadlock or raise
        obs, info = env.reset(seed=2)
        return env.step("<search>secret</search>")

    obs, r, term, trunc, info = asyncio.run(main())
    assert info["role"] == "tool" and "the secret is" in obs
    env.close()
    env.close()
    assert env.closed_async == 1


def play_one_env(seed: int):
    env = SlowSearchEnv(latency=0)
    env.reset(seed=seed)
    env.step("<search>x</search>")
    return env


def play_a_vector(seed: int):
    envs = AsyncVectorEnv([lambda: SlowSearchEnv(latency=0) for _ in range(2)])
    envs.reset(seed=seed)
    envs.step(["<search>x</search>"] * 2)
    return envs


@pytest.mark.parametrize("play", [play_one_env, play_a_vector])
def test_an_unclosed_async_env_gives_back_its_thread_and_descriptors(play):
    """The sync API of an async env (or vector env) runs a private loop in a thread; one dropped
    without close() stops it (counted on the host: the process's threads and open descriptors)."""

    def loops() -> int:
        return sum(t.name == "rl2gem-env-loop" for t in threading.enumerate())

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    threads, fds = loops(), descriptors()
    for seed in range(20):
        env = play(seed)
    assert loops() > threads  # the last one's, while it is referenced
    del env
    gc.collect()
    deadline = time.monotonic() + 10
    while (loops() > threads or descriptors() > fds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loops() <= threads and descriptors() <= fds


def test_closing_a_private_loop_does_not_wait_for_a_job_in_its_executor():
    """A step interrupted (Ctrl-C) while a compute-only env's job runs in the loop's executor:
    close() returns at once and the loop's thread ends, the job finishing on its own."""
    private = _PrivateLoop(None)
    started = threading.Event()

    def job():
        started.set()
        time.sleep(3)

    private.loop.call_soon_threadsafe(private.loop.run_in_executor, None, job)
    assert started.wait(5)
    begun = time.monotonic()
    private.stop()
    assert time.monotonic() - begun < 1
    assert not private.thread.is_alive() and private.loop.is_closed()


def test_async_and_sync_agree_for_async_native_env():
    actions = ["<search>x</search>", "bad", "<answer>0</answer>"]

    def play_sync():
        env = SlowSearchEnv(latency=0)
        out = [env.reset(seed=9)]
        out += [env.step(a) for a in actions]
        env.close()
        return out

    async def play_async():
        env = SlowSearchEnv(latency=0)
        out = [await env.areset(seed=9)]
        out += [await env.astep(a) for a in actions]
        await env.aclose()
        return out

    assert play_sync() == asyncio.run(play_async())


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_turns"):
        CountEnv(max_turns=0)
    with pytest.raises(ValueError, match="render_mode"):
        CountEnv(render_mode="human")
    env = CountEnv(render_mode="ansi")
    obs, _ = env.reset(seed=0)
    assert env.render() == obs
    with pytest.raises(ValueError, match="seed"):
        env.reset(seed=-1)


def test_each_env_samples_from_spaces_of_its_own():
    """The spaces a class declares are copied per env: seeding and sampling one env's action
    space leaves another's draws as they were, and a copy of an env carries its space's state."""
    import copy

    a, b = CountEnv(), CountEnv()
    assert a.action_space is not b.action_space and a.observation_space is not b.observation_space
    a.action_space.seed(3)
    b.action_space.seed(3)
    first = a.action_space.sample()
    b.action_space.sample()
    b.action_space.sample()
    twin = copy.deepcopy(a)
    assert a.action_space.sample() == twin.action_space.sample() != first
    b.action_space.seed(3)
    assert b.action_space.sample() == first


class _Penalty(Wrapper):
    """A wrapper that changes only ``step``: its async twin must not skip it."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward - 100.0, terminated, truncated, info


def test_a_wrapper_that_overrides_only_step_is_applied_by_astep_and_the_vector_env():
    env = _Penalty(SlowSearchEnv(latency=0.0))
    asyncio.run(env.areset(seed=0))
    assert asyncio.run(env.astep("<search>x</search>"))[1] == -100.0 and not env.is_async_native
    env.close()
    venv = rl2gem.AsyncVectorEnv([lambda: _Penalty(SlowSearchEnv(latency=0.0))])
    venv.reset(seed=0)
    assert venv.step(["<search>x</search>"])[1].tolist() == [-100.0]
    venv.close()


def test_rl2gem_wrappers_over_a_gymnasium_wrapper_keep_their_async_api():
    """ChatHistory over TimeLimit (no async twins): its areset and astep run the sync ones."""
    env = rl2gem.ChatHistory(gym.wrappers.TimeLimit(SlowSearchEnv(latency=0.0), 3))
    obs, info = asyncio.run(env.areset(seed=0))
    assert info["messages"][-1]["content"] == obs
    assert asyncio.run(env.astep("<search>x</search>"))[4]["role"] == "tool"
    env.close()


class FlakyResetEnv(Env):
    """One-step episodes over a data set of two items."""

    def _reset(self, options):
        return f"item {self.task_index(2, options)}", {}

    def _step(self, action):
        return "done", 1.0, True, False, {}


def test_a_reset_that_raises_opens_no_episode():
    """After a finished episode, a reset that fails leaves the env needing a reset (a step went on
    with the old episode and a second reward)."""
    env = FlakyResetEnv()
    env.reset(seed=0)
    assert env.step("a")[2]
    with pytest.raises(IndexError):
        env.reset(options={"index": 99})
    with pytest.raises(ResetNeeded):
        env.step("a")
    env.close()


def test_two_steps_at_once_on_one_env_are_refused():
    """A second ``astep`` while the first awaits would run on the first's episode state (both
    returned a finished episode's step); it is a RuntimeError, and the first step completes."""
    env = SlowSearchEnv(latency=0.05)
    env.reset(seed=0)

    async def both():
        return await asyncio.gather(
            env.astep("<search>a</search>"), env.astep("<search>b</search>"), return_exceptions=True
        )

    first, second = asyncio.run(both())
    assert first[4]["role"] == "tool" and isinstance(second, RuntimeError) and "one step at a time" in str(second)
    assert env.step("<search>c</search>")[4]["turn"] == 2  # the refused step took no turn
    env.close()


def test_close_ends_the_loop_thread_even_when_the_close_hook_raises():
    class FailingClose(SlowSearchEnv):
        async def _aclose(self):
            raise OSError("close failed")

    env = FailingClose(latency=0.0)
    env.reset(seed=0)
    thread = env._private_loop.thread
    with pytest.raises(OSError, match="close failed"):
        env.close()
    thread.join(5)
    assert env._private_loop is None and not thread.is_alive()
