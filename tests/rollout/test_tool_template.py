"""Tools rendered by the chat template (``tools_in_template``): the env leaves them out of its text,
the template offers them, tool results become one ``role="tool"`` message each, and the episode
stays one token-in/token-out sequence equal to the template's render."""

import asyncio
import json

import pytest
from test_tito import ScriptedEngine, action_ids

import rl2gem
from rl2gem.rollout import Rollout, RolloutConfig
from rl2gem.rollout.tito import ChatRenderer, load_chat_template

TOOL_ENVS = ["rl2/PythonMath-v0", "rl2/FunctionCall-v0", "rl2/ToolUse-v0"]


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def play(tokenizer, scripts, *, template="chatml_tools", tools_in_template=True, env="rl2/PythonMath-v0"):
    eng = ScriptedEngine(scripts)
    kwargs = rl2gem.standard_kwargs(env, {"split": "test"}, tools_in_template=tools_in_template)
    cfg = RolloutConfig(responses_per_prompt=1, max_new_tokens=64, tools_in_template=tools_in_template)

    async def main():
        ro = Rollout(eng, tokenizer, env, cfg, env_kwargs=kwargs, chat_template=load_chat_template(template))
        batch = await ro.collect(1)
        await ro.close()
        return batch.episodes[0]

    return asyncio.run(main()), eng


def test_the_template_offers_the_tools_and_the_episode_stays_one_sequence(tokenizer):
    two_calls = call("python", code="print(6 * 7)") + "\n" + call("python", code="print(1 + 1)")
    ep, eng = play(tokenizer, [action_ids(tokenizer, two_calls), action_ids(tokenizer, "\\boxed{0}")])
    assert ep.turns == 2 and ep.terminated and len(ep.sequences) == 1 and ep.splits == 0
    first_prompt = tokenizer.decode(eng.calls[0])
    # the schema comes from the template (once), not from the env's text
    assert first_prompt.count('"name": "python"') == 1 and "Functions you may call" in first_prompt
    assert "<tools>" not in ep.messages[0]["content"] and "<tools>" not in first_prompt
    # each call's result is its own tool message; the template wraps each in <tool_response>
    tool_msgs = [m for m in ep.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["42", "2"]
    second = tokenizer.decode(eng.calls[1])
    assert second.startswith(first_prompt) and second.count("<tool_response>") == 2
    # the merged sequence is exactly the template's render of the conversation with the tools
    schemas = rl2gem.make("rl2/PythonMath-v0", split="test", tool_prompt=None).reset(seed=0)[1]["tools"]
    rendered = ChatRenderer(tokenizer, load_chat_template("chatml_tools")).render(ep.messages, tools=schemas)
    assert tokenizer.decode(ep.sequences[0].input_ids) + "\n" == rendered


def test_without_tools_in_template_the_env_text_offers_them(tokenizer):
    ep, eng = play(tokenizer, [action_ids(tokenizer, "\\boxed{0}")], tools_in_template=False)
    prompt = tokenizer.decode(eng.calls[0])
    assert "<tools>" in ep.messages[0]["content"] and "Functions you may call" not in prompt


def test_a_template_without_tool_support_is_refused(tokenizer):
    with pytest.raises(ValueError, match="does not render tools"):
        Rollout(ScriptedEngine([[1]]), tokenizer, "rl2/PythonMath-v0", RolloutConfig(tools_in_template=True))
    assert not ChatRenderer(tokenizer).supports_tools  # SmolLM2's own template has no tools
    assert ChatRenderer(tokenizer, load_chat_template("chatml_tools")).supports_tools


@pytest.mark.parametrize("env_id", TOOL_ENVS)
def test_tool_envs_leave_the_tools_to_the_template_on_request(env_id):
    kwargs = rl2gem.standard_kwargs(env_id, {}, tools_in_template=True)
    assert kwargs == {"tool_prompt": None}
    with rl2gem.make(env_id) as env:
        text_obs, text_info = env.reset(options={"index": 0})
    with rl2gem.make(env_id, **kwargs) as env:
        obs, info = env.reset(options={"index": 0})
    assert "<tools>" in text_obs and "<tools>" not in obs and obs in text_obs
    assert info["tools"] == text_info["tools"] and all(t["type"] == "function" for t in info["tools"])
    with pytest.raises(ValueError, match="must be .append."):
        rl2gem.make(env_id, tool_prompt="inline")


def test_tool_use_lists_each_result():
    env = rl2gem.make("rl2/ToolUse-v0", tool_prompt=None)
    env.reset(options={"index": 0})
    action = env.unwrapped.make_solver()("")
    obs, _, _, _, info = env.step(action)
    assert info["role"] == "tool" and len(info["tool_results"]) == action.count("<tool_call>") >= 1
    assert all(t in obs for t in info["tool_results"])
    env.close()


def test_standard_kwargs_fill_only_what_the_env_takes():
    assert rl2gem.standard_kwargs("rl2/GSM8K-v0", {}, split="test", tools_in_template=True) == {"split": "test"}
    assert rl2gem.standard_kwargs("rl2/GSM8K-v0", {"split": "train"}, split="test") == {"split": "train"}
    assert rl2gem.standard_kwargs("rl2/PythonMath-v0", {"tool_prompt": "prepend"}, tools_in_template=True) == {
        "tool_prompt": "prepend"
    }
    assert rl2gem.standard_kwargs("rl2/Wordle-v0", {}, split="test", tools_in_template=True) == {}


def test_chat_template_option(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ x }}") == "{{ x }}" and load_chat_template(None) is None
    assert "tools" in load_chat_template("chatml_tools")
    with pytest.raises(FileNotFoundError, match="built-in"):
        load_chat_template("no_such_template")
