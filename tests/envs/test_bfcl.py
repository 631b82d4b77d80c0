"""BFCL envs: BFCL's checkers agree with its possible answers through our decoding, and the
multi-turn back-ends reward a scripted gold policy."""

import json

import numpy as np
import pytest
from rl2gem.envs.bfcl import (
    ANY_CALL_CATEGORIES,
    MULTI_TURN_CATEGORIES,
    NO_CALL_CATEGORIES,
    SINGLE_TURN_CATEGORIES,
    FunctionCallEnv,
    ToolUseEnv,
    _bfcl,
    gold_calls,
    load_multi_turn,
    load_single_turn,
)

#: Items whose possible answers no call can satisfy (data quirks of bfcl-eval 2026.3.23: an argument
#: missing from the schema, a required argument whose only allowed value is "", an empty allowed list).
UNSATISFIABLE = {
    "parallel_multiple_12",
    "parallel_multiple_26",
    "live_simple_106-63-0",
    "live_simple_112-68-0",
    "live_multiple_964-207-0",
    "live_multiple_507-149-4",
    "live_multiple_862-181-3",
}


def tool_call(name, args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def play(env, index, action):
    obs, _ = env.reset(options={"index": index})
    _, r, term, _, info = env.step(action(obs) if callable(action) else action)
    assert term
    return r, info


def perturbations(item, rng):
    """Wrong answers built from the gold one: a misspelled function, a missing required argument, a value
    outside the allowed ones."""
    gold = gold_calls(item["ground_truth"])
    (name, args), *rest = [next(iter(c.items())) for c in gold]
    tail = "".join(tool_call(n, a) for n, a in rest)
    out = [tool_call(name + "_v2", args) + tail]
    func = next(f for f in item["functions"] if f["name"] == name)
    required = [k for k in func["parameters"].get("required", []) if k in args]
    if required:
        out.append(tool_call(name, {k: v for k, v in args.items() if k != required[0]}) + tail)
    for k, v in args.items():
        allowed = next(iter(item["ground_truth"][0].values()))[k]
        if isinstance(v, bool):
            bad = not v
        elif isinstance(v, (int, float)):
            bad = v + 1000003
        elif isinstance(v, str):
            bad = v + " zz-not-allowed"
        else:
            continue
        if bad not in allowed:
            out.append(tool_call(name, dict(args, **{k: bad})) + tail)
            break
    return out


@pytest.mark.parametrize("category", SINGLE_TURN_CATEGORIES)
def test_ast_checker_agrees_with_possible_answers(category):
    env = FunctionCallEnv(category)
    solve = env.make_solver()
    rng = np.random.default_rng(0)
    sample = rng.choice(len(env), size=min(15, len(env)), replace=False)
    checked = 0
    for i in sample:
        env.reset(options={"index": int(i)})
        item = env.item
        if item["id"] in UNSATISFIABLE:
            continue
        r, info = play(env, int(i), solve)
        assert r == 1.0 and info["reward_components"]["correctness"] == 1.0, item["id"]
        assert (
            info["reward_components"]["tool_calls"] == len(info["calls"]) and info["reward_components"]["format"] == 1
        )
        if category in NO_CALL_CATEGORIES:
            name = item["functions"][0]["name"] if item["functions"] else "anything"
            assert play(env, int(i), tool_call(name, {}))[0] == 0.0
        elif category in ANY_CALL_CATEGORIES:
            assert play(env, int(i), "I will not call anything.")[0] == 0.0
        else:
            for bad in perturbations(item, rng):
                r, info = play(env, int(i), bad)
                assert r == 0.0 and info["error"], (item["id"], bad)
            r, info = play(env, int(i), "I do not know.")
            assert r == 0.0 and info["reward_components"] == {"correctness": 0.0, "format": 0.0, "tool_calls": 0.0}
        checked += 1
    assert checked >= min(12, len(env))


def test_every_possible_answer_is_reachable_except_the_known_quirks():
    failing = set()
    for category in SINGLE_TURN_CATEGORIES:
        env = FunctionCallEnv(category)
        solve = env.make_solver()
        for i in range(len(env)):
            r, info = play(env, i, solve)
            if r != 1.0:
                failing.add(info["id"])
    assert failing == UNSATISFIABLE


def test_bfcl_python_list_format_is_read_too():
    env = FunctionCallEnv("simple")
    env.reset(options={"index": 0})
    (call,) = gold_calls(env.item["ground_truth"])
    ((name, args),) = call.items()
    text = "[" + f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
    assert play(env, 0, text)[0] == 1.0
    assert play(env, 0, "```python\n" + text + "\n```")[0] == 1.0


def test_categories_splits_and_prompt():
    env = FunctionCallEnv(["simple", "irrelevance"], split="test")
    assert {it["category"] for it in env.items} == {"simple_python", "irrelevance"}
    train = FunctionCallEnv(["simple", "irrelevance"], split="train")
    assert not {it["id"] for it in env.items} & {it["id"] for it in train.items}
    assert len(env) + len(train) == 640
    obs, info = env.reset(options={"index": 0})
    assert "<tools>" in obs and info["tools"][0]["function"]["parameters"]["type"] == "object"
    with pytest.raises(ValueError, match="unknown BFCL"):
        FunctionCallEnv("java")
    mix = FunctionCallEnv("all")
    assert len(mix) == sum(len(load_single_turn(c)) for c in SINGLE_TURN_CATEGORIES)
    assert len({mix.items[i]["category"] for i in range(100)}) >= 6  # the first 100 mix the categories


def run_episode(env, index, policy):
    obs, info = env.reset(options={"index": index})
    while True:
        obs, r, term, trunc, info = env.step(policy(obs))
        if term or trunc:
            return r, info


def executor_instances():
    return [k for k in vars(_bfcl().utils) if k.startswith("rl2gem_")]


def test_scripted_gold_policy_scores_one_on_every_multi_turn_base_task():
    env = ToolUseEnv("base")
    solve = env.make_solver()
    episodes = [run_episode(env, i, solve) for i in range(len(env))]
    assert len(episodes) == 200 and [r for r, _ in episodes] == [1.0] * 200
    gold_calls_per_task = [sum(map(len, item["ground_truth"])) for item in env.items]
    assert [info["reward_components"] for _, info in episodes] == [
        {"correctness": 1.0, "tool_calls": float(n)} for n in gold_calls_per_task
    ]
    env.close()
    assert executor_instances() == []


@pytest.mark.parametrize("category", ["long_context", "miss_param"])
def test_gold_policy_on_other_multi_turn_categories(category):
    env = ToolUseEnv(category)
    solve = env.make_solver()
    assert all(run_episode(env, i, solve)[0] == 1.0 for i in range(0, len(env), 7))


def test_skipping_a_gold_call_fails_the_task():
    env = ToolUseEnv("base")
    gold = env.make_solver()
    failed = 0
    for i in range(0, 200, 10):
        state = {"dropped": False}

        def policy(obs, state=state):
            action = gold(obs)
            if not state["dropped"] and action.count("<tool_call>") >= 1:
                state["dropped"] = True
                return action.rsplit("<tool_call>", 1)[0] or "Done."
            return action

        r, info = run_episode(env, i, policy)
        failed += r == 0.0 and info["error_type"] is not None
    assert failed == 20


def test_calls_have_effects_and_episodes_are_isolated():
    a, b = ToolUseEnv("base"), ToolUseEnv("base")
    a.reset(options={"index": 0})
    b.reset(options={"index": 0})
    obs, r, term, trunc, info = a.step(
        tool_call("cd", {"folder": "document"}) + tool_call("mkdir", {"dir_name": "temp"})
    )
    assert info["role"] == "tool" and '"current_working_directory": "document"' in obs and not term
    assert "temp" in a.step(tool_call("ls", {}))[0]
    assert "temp" not in b.step("[cd(folder='document')]")[0] and "temp" not in b.step("[ls()]")[0]
    obs, *_, info = b.step(tool_call("format_disk", {}) + "<tool_call>{bad json</tool_call>")
    assert "Error: unknown function 'format_disk'" in obs and "not valid JSON" in obs and info["invalid_action"]
    obs, r, term, trunc, info = a.step("I moved the file.")  # ends user turn 0: the next request comes
    assert info["role"] == "user" and info["user_turn"] == 1 and obs.startswith("Perform a detailed search")
    a.close()
    b.close()
    assert executor_instances() == []


def test_tool_results_come_back_in_the_calls_order():
    """A call that could not be read had its error put after every other result: the rollout renders
    one tool message per call in order, so each call got another call's result."""
    env = ToolUseEnv("base")
    env.reset(options={"index": 0})
    action = "<tool_call>{bad json</tool_call>" + tool_call("pwd", {}) + tool_call("no_such_fn", {})
    *_, info = env.step(action)
    results = info["tool_results"]
    assert len(results) == 3 and "not valid JSON" in results[0], results
    assert "current_working_directory" in results[1] and "unknown function 'no_such_fn'" in results[2], results
    env.close()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_mid_episode_has_back_ends_of_its_own_and_still_solves_the_task(how):
    """BFCL keeps an episode's back-ends (here a file system) in its module's globals by name: a
    copy taken mid-episode gets copies of them under names of its own, so its calls do not
    change the original's, closing it leaves the original's in place, and both go on to solve
    the task with the gold policy."""
    import copy
    import pickle

    duplicate = copy.deepcopy if how == "deepcopy" else (lambda env: pickle.loads(pickle.dumps(env)))
    env = ToolUseEnv("base")
    env.reset(options={"index": 0})
    env.step(tool_call("cd", {"folder": "document"}))
    own = executor_instances()
    twin = duplicate(env)
    assert twin._exec_name != env._exec_name and len(own) == 2  # the file system and a Twitter API
    assert len(executor_instances()) == 4
    assert "by_copy" in twin.step(tool_call("mkdir", {"dir_name": "by_copy"}) + tool_call("ls", {}))[0]
    assert "by_copy" not in env.step(tool_call("ls", {}))[0]
    twin.close()
    assert executor_instances() == own
    assert "by_original" in env.step(tool_call("mkdir", {"dir_name": "by_original"}) + tool_call("ls", {}))[0]
    env.close()
    env = ToolUseEnv("base")  # a copy after the gold policy's first user turn scores as the original
    solve = env.make_solver()
    obs, _ = env.reset(options={"index": 3})
    for _ in range(2):  # the turn's calls, then the reply that ends it
        obs, *_, info = env.step(solve(obs))
    assert info["user_turn"] == 1 and env.calls[0]
    twin = duplicate(env)
    rewards = []
    for target, policy in ((twin, twin.make_solver()), (env, solve)):
        state, done = obs, False
        while not done:
            state, reward, terminated, truncated, _ = target.step(policy(state))
            done = terminated or truncated
        rewards.append(reward)
        target.close()
    assert rewards == [1.0, 1.0]
    assert executor_instances() == []


def test_a_pickled_episode_goes_on_in_another_process_with_its_back_ends():
    """Pickled mid-episode and loaded in a fresh process (as a worker would), whose BFCL package is
    not imported yet: the back-ends come with it (the directory made before is there)."""
    import pickle
    import subprocess
    import sys

    env = ToolUseEnv("base")
    env.reset(options={"index": 0})
    env.step(tool_call("cd", {"folder": "document"}) + tool_call("mkdir", {"dir_name": "made_here"}))
    child = (
        "import pickle, sys; env = pickle.loads(sys.stdin.buffer.read()); "
        f"print(env.step({tool_call('ls', {})!r})[0]); env.close()"
    )
    result = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(env), capture_output=True, timeout=120)
    env.close()
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert "made_here" in result.stdout.decode()


def test_step_limit_per_user_turn_truncates():
    env = ToolUseEnv("base", max_steps_per_turn=2)
    env.reset(options={"index": 0})
    env.step(tool_call("ls", {}))
    env.step(tool_call("ls", {}))
    obs, r, term, trunc, info = env.step(tool_call("ls", {}))
    assert (r, term, trunc, info["truncated_reason"]) == (0.0, False, True, "max_steps_per_turn")


def test_refused_actions_count_toward_the_step_limit():
    """Whitespace actions are refused before the env reads them: they never counted, so an episode
    of them never ended (500 steps, not truncated)."""
    env = ToolUseEnv("base", max_steps_per_turn=3)
    env.reset(options={"index": 0})
    for _ in range(3):
        _, _, _, trunc, info = env.step("   ")
        assert not trunc and info["invalid_action"]
    _, r, term, trunc, info = env.step("   ")
    assert (r, term, trunc, info["truncated_reason"]) == (0.0, False, True, "max_steps_per_turn")


def test_no_request_or_conversation_is_on_both_sides_of_the_split():
    """BFCL repeats requests across categories under other ids (multiple_172 is simple_python_311),
    and the multi-turn categories hold variants of one numbered conversation: an id hash put 11
    single-turn and 34 long-context test items beside their train twins."""
    single = [item for category in SINGLE_TURN_CATEGORIES for item in load_single_turn(category)]
    sides: dict[str, set[str]] = {}
    for item in single:
        sides.setdefault(json.dumps(item["messages"], sort_keys=True), set()).add(item["split"])
    assert all(len(found) == 1 for found in sides.values())
    by_number: dict[str, set[str]] = {}
    for category in MULTI_TURN_CATEGORIES:
        for item in load_multi_turn(category):
            by_number.setdefault(item["id"].rsplit("_", 1)[-1], set()).add(item["split"])
    assert all(len(found) == 1 for found in by_number.values())
    assert 0.1 < sum("test" in found for found in by_number.values()) / len(by_number) < 0.3
