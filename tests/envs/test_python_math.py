"""rl2/PythonMath-v0: math problems where the agent may run Python before answering."""

import copy
import json
import os
import pickle

import pytest

import rl2gem
from rl2gem.tools import FunctionTool, ToolEnvWrapper, env_tools


def code_call(code):
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_compute_with_python_then_answer():
    env = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=2)
    assert isinstance(env, ToolEnvWrapper)
    obs, info = env.reset(options={"index": 3})
    answer = env.unwrapped.problem["answer"]
    assert "python" in obs and "\\boxed{}" in obs and info["tools"][0]["function"]["name"] == "python"
    obs, r, term, trunc, info = env.step(code_call(f"x = {answer}\nprint(x * 2)"))
    assert obs.strip() == str(int(answer) * 2) and info["role"] == "tool" and (r, term) == (0.0, False)
    obs, r, term, trunc, info = env.step(code_call("import os\nos.system('ls')"))
    assert "creating processes is disabled" in obs and not term
    obs, r, term, trunc, info = env.step(f"So the answer is \\boxed{{{answer}}}.")
    assert (r, term, info["correct"], info["num_tool_calls"]) == (1.0, True, True, 2)
    assert info["reward_components"] == {"correctness": 1.0, "format": 1.0, "tool_calls": 2.0}
    env.close()


def test_wrong_answer_after_tools_scores_zero_and_limit_truncates():
    env = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=1)
    env.reset(options={"index": 0})
    env.step(code_call("print(1)"))
    obs, r, term, trunc, info = env.step(code_call("print(2)"))
    assert trunc and info["truncated_reason"] == "max_tool_calls" and info["reward_components"] == {"tool_calls": 1.0}
    env.reset(options={"index": 0})
    assert env.step("\\boxed{-123456}")[1] == 0.0
    env.close()


def test_runs_go_through_the_fork_server_and_persistent_keeps_variables():
    from helpers import fork_servers

    env = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=3, persistent=True)
    env.reset(options={"index": 0})
    assert env.step(code_call("x = 20"))[0].startswith("[No output")
    assert env.step(code_call("x + 1"))[0] == "21"
    ours = fork_servers(parent=os.getpid())
    assert ours  # the default: a fork server of this process forks the executions
    env.reset(options={"index": 1})  # a new episode, a new session
    assert "NameError" in env.step(code_call("x"))[0]
    env.close()
    fresh = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", pool_size=0)
    fresh.reset(options={"index": 0})
    assert fresh.step(code_call("print(6 * 7)"))[0] == "42"
    fresh.close()


def pickled(env):
    return pickle.loads(pickle.dumps(env))


@pytest.mark.parametrize("duplicate", [copy.deepcopy, pickled], ids=["deepcopy", "pickle"])
def test_a_copy_after_a_python_call_goes_on_alone_and_the_original_outlives_its_close(duplicate):
    env = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=3)
    env.reset(options={"index": 3})
    answer = env.unwrapped.problem["answer"]
    assert env.step(code_call("print(6 * 7)"))[0] == "42"  # the wrapper's private loop runs now
    twin = duplicate(env)
    assert twin._loop is None and twin.env is not env.env
    assert twin.step(code_call("print(2 + 3)"))[0] == "5"
    obs, r, term, trunc, info = twin.step(f"\\boxed{{{answer}}}")
    assert (r, term, info["num_tool_calls"]) == (1.0, True, 2)
    twin.close()
    assert env._loop.loop.is_running()  # closing the copy stopped its own loop only
    assert env.step(code_call("print(7 * 7)"))[0] == "49"
    obs, r, term, trunc, info = env.step("\\boxed{-1}")
    assert (r, term, info["num_tool_calls"]) == (0.0, True, 2)
    env.close()


def test_a_persistent_session_copies_before_its_first_call_and_refuses_once_its_interpreter_runs():
    env = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=3, persistent=True)
    env.reset(options={"index": 0})
    twin = copy.deepcopy(env)  # no interpreter yet: the copy starts its own
    assert twin.step(code_call("x = 1"))[0].startswith("[No output")
    assert env.step(code_call("x = 20"))[0].startswith("[No output")
    with pytest.raises(TypeError, match="PythonSession whose interpreter runs"):
        copy.deepcopy(env)
    with pytest.raises(TypeError, match="PythonSession whose interpreter runs"):
        pickle.dumps(env)
    assert twin.step(code_call("x + 1"))[0] == "2" and env.step(code_call("x + 1"))[0] == "21"
    twin.close()
    env.close()


def test_a_tool_added_over_the_python_tool_is_offered_with_it_and_the_session_persists():
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: first factor.
            b: second factor.
        """
        return a * b

    base = rl2gem.make("rl2/PythonMath-v0", dataset="gsm8k", split="test", max_tool_calls=3, persistent=True)
    env = ToolEnvWrapper(base, [FunctionTool(multiply)], max_tool_calls=5)
    obs, info = env.reset(options={"index": 0})
    assert [t["function"]["name"] for t in info["tools"]] == ["python", "multiply"]
    assert obs.count("<tools>") == 1 and '"name": "python"' in obs and '"name": "multiply"' in obs
    assert [t.name for t in env_tools(env)] == ["python", "multiply"]
    assert env.step(code_call("x = 20"))[0].startswith("[No output")
    both = code_call("print(x + 1)") + '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    obs, *_, info = env.step(both)  # the inner tool keeps its episode's session
    assert obs == "<tool_response>\n21\n</tool_response>\n<tool_response>\n42\n</tool_response>"
    assert info["num_tool_calls"] == 3  # past the inner wrapper's 3: the outer budget counts
    assert env.step(code_call("x"))[0] == "20"
    with pytest.raises(ValueError, match=r"already has \['python'\]"):
        ToolEnvWrapper(base, [FunctionTool(multiply, name="python")])
    env.close()
