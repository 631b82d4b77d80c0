"""ToolEnvWrapper: tool calls become role='tool' observations; other actions reach the env."""

import asyncio

import gymnasium as gym
import pytest
from gymnasium.error import ResetNeeded

from rl2gem.core import Env
from rl2gem.testing import check_env
from rl2gem.tools import FunctionTool, ToolEnvWrapper


class Quiz(Env):
    """Answer 'What is 17 * 23?' in one step; the reply must contain 391."""

    invalid_action_terminates = True

    def __init__(self):
        super().__init__(max_turns=1)

    def _reset(self, options):
        return "What is 17 * 23?", {}

    def _step(self, action):
        ok = "391" in action
        return "", float(ok), True, False, {"success": ok}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: first factor.
        b: second factor.
    """
    return a * b


IN_FLIGHT = {"now": 0, "peak": 0}


async def slow_echo(text: str) -> str:
    """Echo after a while."""
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["peak"] = max(IN_FLIGHT["peak"], IN_FLIGHT["now"])
    try:
        await asyncio.sleep(0.3)
    finally:
        IN_FLIGHT["now"] -= 1
    return text


def call(name, **args):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def make(**kw):
    return ToolEnvWrapper(Quiz(), [FunctionTool(multiply), FunctionTool(slow_echo)], **kw)


def test_tool_turns_then_answer():
    env = make()
    obs, info = env.reset(seed=0)
    assert obs.startswith("What is 17 * 23?") and '"name": "multiply"' in obs
    assert [t["function"]["name"] for t in info["tools"]] == ["multiply", "slow_echo"]
    obs, r, term, trunc, info = env.step("Let me use the tool. " + call("multiply", a=17, b=23))
    assert (obs, r, term, trunc) == ("391", 0.0, False, False)
    assert info["role"] == "tool" and info["num_tool_calls"] == 1 and info["invalid_action"] is None
    assert env.unwrapped.turn == 0  # the quiz was not stepped
    obs, r, term, trunc, info = env.step("The answer is 391.")
    assert (r, term, info["success"], info["turn"], info["num_tool_calls"]) == (1.0, True, True, 2, 1)
    with pytest.raises(ResetNeeded):
        env.step("again")


def test_parallel_calls_come_back_in_order():
    env = make()
    env.reset(seed=0)
    obs, *_, info = env.step(call("slow_echo", text="first") + call("multiply", a=2, b=3))
    assert obs == "<tool_response>\nfirst\n</tool_response>\n<tool_response>\n6\n</tool_response>"
    assert [c["name"] for c in info["tool_calls"]] == ["slow_echo", "multiply"]


@pytest.mark.parametrize(
    "action, message",
    [
        (call("divide", a=1, b=2), "unknown tool 'divide'; the available tools are multiply, slow_echo"),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1,</tool_call>', "not valid JSON"),
        (call("multiply", a=1), "'b' is a required property"),
        (call("multiply", a="one", b=2), "'one' is not of type 'integer'"),
    ],
)
def test_bad_calls_get_clear_observations_and_the_episode_goes_on(action, message):
    env = make()
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(action)
    assert message in obs and obs.startswith("Error") and (r, term, trunc) == (0.0, False, False)
    assert info["invalid_action"] and info["num_invalid_actions"] == 1 and info["role"] == "tool"
    assert env.step("391")[1] == 1.0


def test_call_limit_truncates_with_a_clear_observation():
    env = make(max_tool_calls=2)
    env.reset(seed=0)
    env.step(call("multiply", a=1, b=2))
    obs, r, term, trunc, info = env.step(call("multiply", a=1, b=2) + call("multiply", a=3, b=4))
    assert "Tool-call limit reached" in obs and "none of the 2 requested was run" in obs
    assert (term, trunc, info["truncated_reason"], info["num_tool_calls"]) == (False, True, "max_tool_calls", 2)
    assert info["num_invalid_actions"] == 0  # the episode's count reaches its last info (objectives read it)
    with pytest.raises(ResetNeeded):
        env.step("391")
    env.reset(seed=1)  # a new episode has the full budget again
    assert env.step(call("multiply", a=1, b=2))[0] == "2"


def test_async_episodes_overlap_and_spawn_keeps_the_tools():
    env = make()
    env.reset(seed=3)
    envs, observations, infos = env.spawn(4)
    assert all(
        isinstance(e, ToolEnvWrapper) and o == observations[0] and "tools" in i
        for e, o, i in zip(envs, observations, infos, strict=True)
    )

    async def episode(e):
        obs, *_ = await e.astep(call("slow_echo", text="hi"))
        return obs, (await e.astep("391"))[1]

    async def main():
        return await asyncio.gather(*(episode(e) for e in envs))

    IN_FLIGHT.update(now=0, peak=0)
    out = asyncio.run(main())
    assert out == [("hi", 1.0)] * 4 and IN_FLIGHT["peak"] == 4  # the four tool calls were in flight at once
    for e in envs:
        e.close()


def test_prompt_placement_and_argument_checks():
    env = make(prompt="prepend")
    obs, _ = env.reset(seed=0)
    assert obs.endswith("What is 17 * 23?") and obs.startswith("You can use the tools")
    obs, _ = make(prompt=None).reset(seed=0)
    assert obs == "What is 17 * 23?"
    with pytest.raises(ValueError, match="unique"):
        ToolEnvWrapper(Quiz(), [FunctionTool(multiply), FunctionTool(multiply)])
    with pytest.raises(TypeError, match="not a Tool"):
        ToolEnvWrapper(Quiz(), [multiply])


def test_wrapped_env_passes_check_env():
    check_env(make(), make=make)


def test_a_tool_result_longer_than_the_observation_space_is_cut_to_it():
    """A tool's 70,000 characters and a tool prompt over a short space: the wrapper's observations
    are cut to the space's ``max_length`` (marked), as an env's own text is, so Gymnasium's
    process vector env (shared memory sized by that length) runs on; a text too long for the
    space's flattening names the limit."""
    from gymnasium.spaces.utils import flatten

    from rl2gem.core import TextSpace, fit_observation

    def big(n: int) -> str:
        """A long text.

        Args:
            n: its length.
        """
        return "x" * n

    def make():
        return ToolEnvWrapper(gym.make("rl2/GuessTheNumber-v0", difficulty="easy"), [FunctionTool(big)])

    call = '<tool_call>{"name": "big", "arguments": {"n": 70000}}</tool_call>'
    env = make()
    env.reset(seed=0)
    obs = env.step(call)[0]
    limit = env.observation_space.max_length
    assert len(obs) == limit and obs.endswith("[... observation truncated]") and obs in env.observation_space
    # the results the rollout renders (one message each, not the observation) are cut too: each to
    # its share of the space (they went whole into the prompt)
    *_, info = env.step(call + call)
    assert [len(text) for text in info["tool_results"]] == [limit // 2] * 2
    assert all(text.endswith("[... observation truncated]") for text in info["tool_results"])
    env.close()
    envs = gym.vector.AsyncVectorEnv([make])
    try:
        envs.reset(seed=0)
        assert envs.step([call])[0] == (obs,)
    finally:
        envs.close()
    short = make()
    short.unwrapped.observation_space = TextSpace(64)
    obs, _ = short.reset(seed=0)  # the question and the tool prompt: more than 64 characters
    assert len(obs) == 64 and obs.endswith("[... observation truncated]")
    short.close()
    for limit in (10, 28, 29):  # shorter than the marker: cut without it
        fitted = fit_observation("y" * 100, TextSpace(limit))
        assert len(fitted) == limit and fitted in TextSpace(limit)
        assert fitted.endswith("truncated]") == (limit > 28)
    with pytest.raises(ValueError, match="70000 characters does not fit TextSpace"):
        flatten(TextSpace(10), "x" * 70000)
