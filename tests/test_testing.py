"""check_env over the whole registry, and that it catches broken envs."""

import asyncio
import threading
import time

import pytest
from toy_envs import CountEnv, GlobalRandomEnv, SlowSearchEnv

import rl2gem
from rl2gem import Env
from rl2gem.testing import check_env


class SharedBox:
    """A value every copy shares, as a resource handed on as it is would be."""

    def __init__(self):
        self.value = 0

    def __deepcopy__(self, memo):
        return self


class SharedTurnsEnv(Env):
    """Broken on purpose: its turn count lives in a box its copies share."""

    def _reset(self, options):
        self.box = SharedBox()
        return "Say anything.", {}

    def _step(self, action):
        self.box.value += 1
        return f"turn {self.box.value}", 0.0, False, self.box.value >= 4, {}


class LockedEnv(CountEnv):
    """Holds a lock, which no copy can take."""

    def _reset(self, options):
        self.lock = threading.Lock()
        return super()._reset(options)


class ClosingSharedEnv(CountEnv):
    """Broken on purpose: its copies write to a log that only the original closes (a registry of
    open resources by name, as BFCL's back-ends live in module globals): a copy goes on while
    its original is open, and fails once it is closed."""

    logs: dict[str, list] = {}

    def _reset(self, options):
        self.name, self.owner = "log", True
        ClosingSharedEnv.logs[self.name] = []
        return super()._reset(options)

    def __setstate__(self, state):
        self.__dict__.update(state, owner=False)

    def _step(self, action):
        ClosingSharedEnv.logs[self.name].append(action)  # KeyError once the log is closed
        return super()._step(action)

    def _close(self):
        if getattr(self, "owner", False):
            ClosingSharedEnv.logs.pop(self.name, None)


# rl2/Remote-v0 needs a server: tests/test_envserver.py checks it against served envs
@pytest.mark.parametrize("env_id", [e for e in rl2gem.list_envs(namespace=None) if e != "rl2/Remote-v0"])
def test_every_registered_env_passes_check_env(env_id):
    check_env(env_id)


@pytest.mark.parametrize("factory", [CountEnv, lambda: SlowSearchEnv(latency=0)])
def test_toy_envs_pass(factory):
    check_env(factory())


def test_catches_an_env_that_ignores_its_seed():
    with pytest.raises(AssertionError):
        check_env(GlobalRandomEnv())


def test_catches_an_env_that_crashes_on_bad_input():
    class Fragile(CountEnv):
        def _step(self, action):
            return super()._step(action) if action.isascii() else int("not a number")

    with pytest.raises(AssertionError, match="raised ValueError"):
        check_env(Fragile())


def test_an_env_that_raises_on_a_format_error_or_overrides_step_is_told_what_to_do():
    class Strict(CountEnv):
        def _step(self, action):
            raise ValueError("no answer tag")

    class OwnStep(CountEnv):
        def step(self, action):
            return "x", 0.0, True, False, {}

    with pytest.raises(
        AssertionError, match=r"ValueError: no answer tag \(it plays random text: answer .*invalid_action"
    ):
        check_env(Strict())
    with pytest.raises(
        AssertionError, match="info\\['role'\\] = None; an env that overrides step\\(\\) .* override _step"
    ):
        check_env(OwnStep())


def test_check_env_runs_inside_a_running_event_loop():
    """In a Jupyter cell or any async code: ``asyncio.run`` refused ("cannot be called from a
    running event loop"), and the async play's coroutine was never awaited. Its checks still hold
    there: the blocking env is still caught."""

    class Blocking(SlowSearchEnv):
        async def _astep(self, action):
            time.sleep(0.12)
            return await super()._astep(action)

    async def in_a_loop():
        check_env(SlowSearchEnv(latency=0.01), num_steps=3)
        check_env("rl2/GuessTheNumber-v0")
        with pytest.raises(AssertionError, match=r"blocked the event loop"):
            check_env(Blocking(latency=0), num_steps=3)

    asyncio.run(in_a_loop())


def test_catches_an_async_env_that_blocks_the_event_loop():
    class Blocking(SlowSearchEnv):
        async def _astep(self, action):
            time.sleep(0.12)  # a blocking call: the loop's other episodes wait
            return await super()._astep(action)

    check_env(SlowSearchEnv(latency=0.12), num_steps=3)  # awaiting as long is fine
    with pytest.raises(AssertionError, match=r"3 of 4 areset/astep calls blocked the event loop"):
        check_env(Blocking(latency=0), num_steps=3)


def test_catches_an_env_whose_async_twin_disagrees():
    class Split(SlowSearchEnv):
        async def _astep(self, action):
            obs, r, term, trunc, info = await super()._astep(action)
            import threading

            # differs between the private loop (sync API) and the caller's loop (async API)
            return obs, r + (threading.current_thread().name == "rl2gem-env-loop"), term, trunc, info

    with pytest.raises(AssertionError, match="disagree"):
        check_env(Split(latency=0))


def test_catches_tool_envs_that_break_the_conventions():
    class BadSchema(CountEnv):
        def _reset(self, options):
            obs, info = super()._reset(options)
            return obs, dict(info, tools=[{"name": "count", "parameters": {}}])  # not {"type": "function", ...}

    with pytest.raises(AssertionError, match="non-function schema"):
        check_env(BadSchema())

    class LostResult(CountEnv):
        def _step(self, action):
            obs, r, term, trunc, info = super()._step(action)
            return obs, r, term, trunc, dict(info, role="tool", tool_results=["42"])  # "42" is not in obs

    with pytest.raises(AssertionError, match="missing from the observation"):
        check_env(LostResult())


def test_catches_an_env_whose_copies_share_its_state_or_cannot_be_made():
    with pytest.raises(AssertionError, match=r"the original went on otherwise after its copy \(copy.deepcopy\)"):
        check_env(SharedTurnsEnv())
    with pytest.raises(AssertionError, match="copy.deepcopy of an env in an episode raised TypeError: cannot pickle"):
        check_env(LockedEnv())
    with pytest.raises(
        AssertionError, match=r"raised KeyError: .log. \(in a copy by pickle, after its original was closed"
    ):
        check_env(ClosingSharedEnv())
    check_env(SharedTurnsEnv(), copies=False)
    check_env(LockedEnv(), copies=False)
    check_env(ClosingSharedEnv(), copies=False)
