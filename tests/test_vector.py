"""AsyncVectorEnv / SyncVectorEnv: autoreset, subsets, failures, concurrency, agreement."""

import asyncio
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode
from toy_envs import CountEnv, FlakyEnv, SlowSearchEnv

import rl2gem
from rl2gem import AsyncVectorEnv, SyncVectorEnv

VECTORS = [AsyncVectorEnv, SyncVectorEnv]


@pytest.mark.parametrize("cls", VECTORS)
def test_next_step_autoreset_keeps_final_obs_and_info(cls):
    venv = cls([lambda: CountEnv() for _ in range(2)])
    assert venv.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert isinstance(venv, gym.vector.VectorEnv)
    obs, infos = venv.reset(seed=0)
    goal = infos[0]["goal"]
    for k in range(1, goal + 1):
        obs, rew, term, trunc, infos = venv.step({0: str(k)})
    # the finishing step returns the final observation and info, not a reset one
    assert term.tolist() == [True] and rew.tolist() == [1.0] and obs == ["Done."]
    assert infos[0]["turn"] == goal and "autoreset" not in infos[0]
    assert venv.final_observations[0] == "Done." and venv.final_infos[0]["turn"] == goal
    # the next step ignores the action and starts a new episode
    obs, rew, term, trunc, infos = venv.step({0: "ignored"})
    assert infos[0]["autoreset"] is True and obs[0].startswith("Count to")
    assert rew.tolist() == [0.0] and not term[0] and not trunc[0]
    assert infos[0]["seed"] != 0  # a fresh episode seed from the env's seed stream
    # env 1 was never stepped: untouched
    assert venv.envs[1].turn == 0
    venv.close()


@pytest.mark.parametrize("cls", VECTORS)
def test_subset_stepping_returns_only_chosen_envs_in_order(cls):
    venv = cls([lambda: CountEnv() for _ in range(4)])
    venv.reset(seed=1)
    obs, rew, term, trunc, infos = venv.step({3: "1", 1: "x"})
    assert len(obs) == 2 and rew.shape == (2,) and term.dtype == bool
    assert obs[0] == "Next." and infos[1]["invalid_action"] == "not a number"
    assert [e.turn for e in venv.envs] == [0, 1, 0, 1]
    with pytest.raises(IndexError):
        venv.step({7: "1"})
    with pytest.raises(ValueError):
        venv.step(["1", "2"])  # a full step needs one action per env
    venv.close()


@pytest.mark.parametrize("cls", VECTORS)
def test_raising_env_is_isolated_and_reset(cls):
    venv = cls([FlakyEnv, FlakyEnv, FlakyEnv])
    venv.reset(seed=0)
    obs, rew, term, trunc, infos = venv.step(["a", "boom", "c"])
    assert obs == ["echo a", "", "echo c"]
    assert trunc.tolist() == [False, True, False]
    assert "RuntimeError: env exploded" in infos[1]["error"] and "Traceback" in infos[1]["traceback"]
    obs, rew, term, trunc, infos = venv.step(["a", "b", "c"])
    assert infos[1]["autoreset"] is True and obs[1].startswith("Say anything")
    obs, *_ = venv.step(["a", "b", "c"])
    assert obs[1] == "echo b"
    venv.close()


@pytest.mark.parametrize("cls", VECTORS)
def test_step_before_reset_raises(cls):
    venv = cls([CountEnv])
    with pytest.raises(ResetNeeded):
        venv.step(["1"])
    venv.close()


def test_async_and_sync_vectors_agree_on_mixed_envs():
    fns = [CountEnv, lambda: SlowSearchEnv(latency=0), CountEnv, lambda: SlowSearchEnv(latency=0)]
    rng = np.random.default_rng(0)
    script = [
        [
            str(int(rng.integers(1, 4)))
            if i % 2 == 0
            else rng.choice(["<search>a</search>", "<answer>1</answer>", "?"])
            for i in range(4)
        ]
        for _ in range(12)
    ]

    def run(cls):
        venv = cls(fns)
        out = [venv.reset(seed=4)]
        for actions in script:
            o, r, te, tr, inf = venv.step(list(actions))
            out.append((o, r.tolist(), te.tolist(), tr.tolist(), inf))
        venv.close()
        return out

    assert run(AsyncVectorEnv) == run(SyncVectorEnv)


@pytest.mark.parametrize("limit", [None, 3])
def test_async_vector_steps_io_envs_concurrently_up_to_the_limit(limit):
    SlowSearchEnv.in_flight = SlowSearchEnv.max_in_flight = 0
    venv = AsyncVectorEnv([lambda: SlowSearchEnv(latency=0.02) for _ in range(8)], max_concurrency=limit)

    async def main():
        await venv.areset(seed=0)
        out = await venv.astep(["<search>q</search>"] * 8)
        await venv.aclose()
        return out

    obs, *_, infos = asyncio.run(main())
    assert all(o.startswith("<information>") for o in obs) and all(i["role"] == "tool" for i in infos)
    assert SlowSearchEnv.max_in_flight == (limit or 8)
    assert all(e.closed_async == 1 for e in venv.envs)


@pytest.mark.parametrize("mode", ["batched", "threaded"])
def test_sync_env_modes_agree(mode):
    def run(m):
        venv = AsyncVectorEnv([CountEnv for _ in range(5)], sync_envs=m)
        venv.reset(seed=2)
        out = [venv.step([str(k)] * 5) for k in (1, 2, 3, 9)]
        venv.close()
        return [(o, r.tolist(), i) for o, r, _, _, i in out]

    assert run(mode) == run("batched")


def test_make_vec_with_mixed_ids_and_kwargs():
    venv = rl2gem.make_vec(
        ["rl2/GuessTheNumber-Easy-v0", "rl2/GuessTheNumber-Hard-v0"], env_kwargs=[{}, {"max_turns": 3}]
    )
    obs, infos = venv.reset(seed=0)
    assert "between 1 and 10" in obs[0] and "between 1 and 50" in obs[1]
    assert venv.envs[1].unwrapped.max_turns == 3
    with pytest.raises(ValueError, match="num_envs"):
        rl2gem.make_vec("rl2/GuessTheNumber-v0")
    with pytest.raises(ValueError, match="vectorization_mode"):
        rl2gem.make_vec("rl2/GuessTheNumber-v0", 2, vectorization_mode="ray")
    sync = rl2gem.make_vec("rl2/GuessTheNumber-v0", 2, vectorization_mode="sync")
    assert isinstance(sync, SyncVectorEnv)
    venv.close()
    sync.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_make_vec_takes_gymnasium_s_autoreset_mode_and_names_its_partial_reset(mode):
    """``make_vec(..., autoreset_mode=...)`` went to the envs' constructor ("unknown argument(s)
    ['autoreset_mode']"); Gymnasium's ``options={"reset_mask": ...}`` reset every env."""
    venv = rl2gem.make_vec("rl2/GuessTheNumber-v0", 2, vectorization_mode=mode, autoreset_mode=AutoresetMode.SAME_STEP)
    assert venv.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    venv.reset(seed=0)
    with pytest.raises(ValueError, match=r"Gymnasium's partial reset; here pass the envs to reset as indices=\[1\]"):
        venv.reset(options={"reset_mask": np.array([False, True])})
    venv.close()


class Sleepy(CountEnv):
    """Fast until told to be slow."""

    slow = False

    def _step(self, action):
        if type(self).slow:
            import time

            time.sleep(0.05)
        return super()._step(action)


def test_compute_envs_move_inline_only_while_fast_and_leave_for_good():
    Sleepy.slow = False
    venv = AsyncVectorEnv([Sleepy, Sleepy], inline_below_s=1e-3)

    async def steps(k):
        for _ in range(k):
            await venv.astep(["1", "1"])
        return threading.get_ident()

    async def main():
        await venv.areset(seed=0)
        assert not venv.runs_inline  # starts in the worker thread
        loop_thread = await steps(12)
        assert venv.runs_inline
        for e in venv.envs:
            e.step_threads.clear()
        await steps(2)
        assert {loop_thread} == venv.envs[0].step_threads  # ran on the loop
        Sleepy.slow = True
        await steps(1)  # one slow step on the loop, then never again
        assert not venv.runs_inline
        for e in venv.envs:
            e.step_threads.clear()
        Sleepy.slow = False
        await steps(20)
        assert not venv.runs_inline and loop_thread not in venv.envs[0].step_threads

    asyncio.run(main())
    venv.close()


def test_inline_disabled_with_zero_threshold():
    venv = AsyncVectorEnv([CountEnv], inline_below_s=0)
    venv.reset(seed=0)
    for _ in range(20):
        venv.step(["1"])
    assert not venv.runs_inline
    venv.close()


@pytest.mark.parametrize("cls", VECTORS)
def test_same_step_autoreset_returns_new_start_and_final_in_info(cls):
    venv = cls([CountEnv, CountEnv], autoreset_mode=AutoresetMode.SAME_STEP)
    assert venv.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    obs, infos = venv.reset(seed=0)
    goal = infos[0]["goal"]
    for k in range(1, goal + 1):
        obs, rew, term, trunc, infos = venv.step({0: str(k)})
    # the finishing step: reward and flags of the end, observation of the new episode
    assert term.tolist() == [True] and rew.tolist() == [1.0]
    assert obs[0].startswith("Count to") and infos[0]["final_obs"] == "Done."
    assert infos[0]["final_info"]["turn"] == goal and "turn" not in infos[0]
    assert venv.final_observations[0] == "Done."
    # the next action already plays the new episode
    obs, rew, term, trunc, infos = venv.step({0: "1"})
    assert "autoreset" not in infos[0] and infos[0]["turn"] == 1 and obs[0] == "Next."
    venv.close()


def test_same_step_resets_a_raising_env_at_once():
    venv = AsyncVectorEnv([FlakyEnv, FlakyEnv], autoreset_mode="SameStep")
    venv.reset(seed=0)
    obs, rew, term, trunc, infos = venv.step(["boom", "x"])
    assert trunc.tolist() == [True, False] and obs[0].startswith("Say anything")
    assert "env exploded" in infos[0]["final_info"]["error"]
    obs, *_ = venv.step(["y", "x"])
    assert obs[0] == "echo y"
    with pytest.raises(ValueError):
        AsyncVectorEnv([FlakyEnv], autoreset_mode="Sometimes")
    venv.close()


def test_an_async_env_under_a_gymnasium_wrapper_is_stepped_concurrently():
    """TimeLimit hides an async env's ``astep``: such envs each get a thread of their own, not the
    serial batch of compute-bound sync envs (4 envs waiting 0.2 s on I/O took 0.8 s a step)."""
    venv = AsyncVectorEnv([lambda: gym.wrappers.TimeLimit(SlowSearchEnv(latency=0.2), 5)] * 4)
    venv.reset(seed=0)
    assert venv._native == [False] * 4 and venv._own_thread == [True] * 4
    start = time.perf_counter()
    _, _, _, _, infos = venv.step(["<search>x</search>"] * 4)
    assert time.perf_counter() - start < 0.6 and all(info["role"] == "tool" for info in infos)
    venv.close()


def test_an_int_seed_gives_env_i_seed_plus_i_also_when_it_is_reset_alone():
    venv = SyncVectorEnv([CountEnv] * 3)
    _, together = venv.reset(seed=10)
    _, alone = venv.reset(seed=10, indices=[2])
    assert [info["seed"] for info in together] == [10, 11, 12] and alone[0]["seed"] == 12
    assert alone[0]["goal"] == together[2]["goal"]
    venv.close()


class CloseRecordingEnv(CountEnv):
    """Records its close in ``closed``; the one with ``fail=True`` raises there instead."""

    closed: list[int] = []

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail

    def _close(self):
        if self.fail:
            raise RuntimeError("close failed")
        CloseRecordingEnv.closed.append(id(self))


@pytest.mark.parametrize("cls", VECTORS)
def test_close_closes_every_env_when_one_raises(cls):
    CloseRecordingEnv.closed = []
    venv = cls([lambda: CloseRecordingEnv(fail=True), CloseRecordingEnv, CloseRecordingEnv])
    venv.reset(seed=0)
    with pytest.raises(RuntimeError, match="close failed"):
        venv.close()
    assert len(CloseRecordingEnv.closed) == 2 and venv.closed
    assert getattr(venv, "_loop", None) is None  # the async vector's loop thread ended too
    venv.close()  # closed: nothing to do, nothing raised


class FailingSecondResetEnv(CountEnv):
    """A CountEnv whose second reset raises once (a service down for a moment)."""

    def __init__(self):
        super().__init__()
        self.resets = 0

    def _reset(self, options):
        self.resets += 1
        if self.resets == 2:
            raise RuntimeError("reset failed")
        return super()._reset(options)


@pytest.mark.parametrize("cls", VECTORS)
def test_a_failed_autoreset_keeps_the_final_episode_and_is_retried(cls):
    venv = cls([FailingSecondResetEnv])
    _, infos = venv.reset(seed=0)
    for k in range(1, infos[0]["goal"] + 1):
        venv.step([str(k)])
    assert venv.final_observations[0] == "Done."
    obs, reward, terminated, truncated, infos = venv.step(["ignored"])  # the autoreset raises
    assert obs == [""] and reward.tolist() == [0.0] and not terminated[0] and not truncated[0]
    assert infos[0]["reset_error"] == "RuntimeError: reset failed" and "error" not in infos[0]
    assert venv.final_observations[0] == "Done." and venv.final_infos[0]["turn"] == venv.envs[0].goal
    obs, _, _, _, infos = venv.step(["ignored"])  # tried again
    assert infos[0]["autoreset"] is True and obs[0].startswith("Count to") and venv.envs[0].resets == 3
    venv.close()


def test_a_wrapper_over_a_gymnasium_time_limit_closes():
    """rl2gem wrappers over ``gym.make(..., max_episode_steps=N)``'s TimeLimit, which has no
    ``aclose``: closing the vector env raised AttributeError and left every env open."""
    from rl2gem.wrappers import ChatHistory

    CloseRecordingEnv.closed = []

    def make():
        return ChatHistory(gym.wrappers.TimeLimit(CloseRecordingEnv(), 3))

    venv = AsyncVectorEnv([make, make])
    venv.reset(seed=0)
    venv.close()
    assert len(CloseRecordingEnv.closed) == 2

    async def main():
        vector = AsyncVectorEnv([make, make])
        await vector.areset(seed=0)
        await vector.aclose()

    asyncio.run(main())
    assert len(CloseRecordingEnv.closed) == 4
