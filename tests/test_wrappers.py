import asyncio

import gymnasium as gym
from toy_envs import CountEnv, SlowSearchEnv

from rl2gem import ChatHistory


def test_chat_history_rebuilds_the_conversation():
    env = ChatHistory(CountEnv(), system_prompt="Be brief.")
    obs, info = env.reset(seed=0)
    assert info["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": obs},
    ]
    env.step("1")
    obs, r, term, trunc, info = env.step("5")
    assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert info["messages"][-2] == {"role": "assistant", "content": "5"}
    assert info["messages"][-1] == {"role": "user", "content": obs}
    # the info list is a copy; mutating it does not change the wrapper's history
    info["messages"].clear()
    assert len(env.messages) == 6


def test_chat_history_async_and_tool_role():
    env = ChatHistory(SlowSearchEnv(latency=0), include_in_info=False)

    async def main():
        await env.areset(seed=1)
        _, _, _, _, info = await env.astep("<search>secret</search>")
        await env.astep(f"<answer>{env.unwrapped.secret}</answer>")
        await env.aclose()
        return info

    info = asyncio.run(main())
    assert "messages" not in info
    roles = [m["role"] for m in env.messages]
    # the final answer gets no reply, so no empty message is appended
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_chat_history_is_a_gymnasium_wrapper():
    env = ChatHistory(CountEnv())
    assert isinstance(env, gym.Wrapper) and env.unwrapped.__class__ is CountEnv


def test_gym_make_of_a_chat_history_spec_builds_it_again():
    env = ChatHistory(gym.make("rl2/GuessTheNumber-v0"), system_prompt="Be brief.", include_in_info=False)
    again = gym.make(env.spec)
    assert isinstance(again, ChatHistory) and again.system_prompt == "Be brief." and again.include_in_info is False
    obs, info = again.reset(seed=0)
    assert again.messages[0] == {"role": "system", "content": "Be brief."} and "messages" not in info
    assert obs == env.reset(seed=0)[0]
