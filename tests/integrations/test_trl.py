"""rl2gem envs inside TRL's GRPOTrainer: data set, env-scored rewards, and a multi-turn env whose
tool calls reach the env on this host (one GRPO step each, tiny models, CPU)."""

import json
import os
import re
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from tiny import tiny_model
from transformers import AutoTokenizer

import rl2gem
from rl2gem.integrations.trl import EnvironmentTool, env_dataset, env_factory, env_reward
from rl2gem.tools import FunctionTool, ToolEnvWrapper

trl = pytest.importorskip("trl")  # the bench extra (pinned in the lock)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ARITHMETIC = {"task": "basic_arithmetic"}


def grpo_config(tmp_path, max_completion_length=32, **kw):
    return trl.GRPOConfig(
        max_completion_length=max_completion_length,
        output_dir=str(tmp_path / "trl"),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        learning_rate=1e-3,
        beta=0.0,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
        **kw,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.padding_side = "left"
    return tok


def test_the_dataset_holds_each_tasks_first_observation_and_how_to_reset_to_it():
    data = env_dataset("rl2/ReasoningGym-v0", n=3, split="train", **ARITHMETIC)
    assert data.column_names == ["prompt", "rl2gem_seed", "rl2gem_index"] and len(data) == 3
    env = rl2gem.make("rl2/ReasoningGym-v0", split="train", **ARITHMETIC)
    for row in data:
        obs, _ = env.reset(seed=row["rl2gem_seed"])
        assert row["prompt"] == [{"role": "user", "content": obs}]
    indexed = env_dataset("rl2/SearchQA-v0", n=2, split="test")
    assert indexed["rl2gem_index"] == [0, 1]


def test_a_reward_of_another_split_than_the_data_set_is_refused_not_scored_against_other_tasks():
    """The rows carry only seeds and indexes: a reward made with the default split scored a test
    data set's correct answers against the train items of the same indexes (0.0, no warning)."""
    data = env_dataset("rl2/SearchQA-v0", n=2, split="test")
    env = rl2gem.make("rl2/SearchQA-v0", split="test")
    answers = []
    for row in data:
        env.reset(options={"index": row["rl2gem_index"]})
        answers.append([{"role": "assistant", "content": f"<answer>{env.unwrapped.item['answers'][0]}</answer>"}])
    env.close()
    kwargs = {"rl2gem_seed": data["rl2gem_seed"], "rl2gem_index": data["rl2gem_index"], "prompts": data["prompt"]}
    same = env_reward("rl2/SearchQA-v0", split="test")
    assert same(completions=answers, **kwargs) == [1.0, 1.0]
    same.close()
    with pytest.raises(ValueError, match="to another task than its prompt: give env_reward / env_factory the split"):
        env_reward("rl2/SearchQA-v0")(completions=answers, **kwargs)  # split="train"
    tool = EnvironmentTool("rl2/SearchQA-v0")
    with pytest.raises(ValueError, match="another task than its prompt"):
        tool.reset(**data[0])
    tool._close()
    # instructions a data set's map added around the observation are fine
    edited = [[{"role": "user", "content": p[0]["content"] + "\nAnswer briefly."}] for p in data["prompt"]]
    assert env_reward("rl2/SearchQA-v0", split="test")(completions=answers, **{**kwargs, "prompts": edited}) == [
        1.0,
        1.0,
    ]


def test_a_completion_ending_on_a_tool_call_plays_no_final_move():
    """TRL's tool loop can stop (its iteration or length limit) after a call: the prose of the
    calling message was played as an extra move (an invalid one, counted)."""
    tool = EnvironmentTool("rl2/GuessTheNumber-v0")
    tool.reset(rl2gem_seed=0)
    tool.act("\\boxed{50}")
    call = {"role": "assistant", "content": "Let me start low.", "tool_calls": [{"function": {"name": "act"}}]}
    for completion in ([call], [call, {"role": "tool", "content": "Lower."}]):
        assert env_reward("rl2/GuessTheNumber-v0")(completions=[completion], environments=[tool]) == [0.0]
    assert tool.info["turn"] == 1 and tool.info.get("num_invalid_actions", 0) == 0
    tool._close()


def test_the_reward_is_the_envs_own_verdict():
    data = env_dataset("rl2/ReasoningGym-v0", n=3, split="train", **ARITHMETIC)
    env = rl2gem.make("rl2/ReasoningGym-v0", split="train", **ARITHMETIC).unwrapped
    answers = []
    for row in data:
        env.reset(seed=row["rl2gem_seed"])
        answers.append(str(env.item["answer"]))
    reward = env_reward("rl2/ReasoningGym-v0", **ARITHMETIC)
    right = [[{"role": "assistant", "content": f"<answer>{a}</answer>"}] for a in answers]
    wrong = [[{"role": "assistant", "content": f"<answer>{a}1</answer>"}] for a in answers]
    kw = {"rl2gem_seed": data["rl2gem_seed"], "rl2gem_index": data["rl2gem_index"]}
    logged = {}
    assert reward(completions=right, **kw, log_metric=logged.__setitem__) == [1.0, 1.0, 1.0]
    # the rubric's parts, as TRL's log_metric takes them: the right answers' correctness and format
    assert logged == {f"rl2gem/ReasoningGym-v0/{k}": 1.0 for k in ("correctness", "format", "success")}
    mixed = [right[0], wrong[1], [{"role": "assistant", "content": "no tags"}]]
    assert reward(completions=mixed, **kw, log_metric=logged.__setitem__) == [1.0, 0.0, 0.0]
    assert logged["rl2gem/ReasoningGym-v0/correctness"] == pytest.approx(1 / 3)
    assert logged["rl2gem/ReasoningGym-v0/format"] == pytest.approx(2 / 3)
    assert logged["rl2gem/ReasoningGym-v0/success"] == pytest.approx(1 / 3)
    assert reward(completions=wrong, **kw) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="n >= 1"):
        env_dataset("rl2/ReasoningGym-v0", n=0, **ARITHMETIC)
    assert reward.__name__ == "rl2gem/ReasoningGym-v0"
    with pytest.raises(KeyError, match="env_dataset"):
        reward(completions=right)


def test_one_grpo_step_on_a_single_turn_env(tmp_path, tokenizer):
    scored = []
    reward = env_reward("rl2/ReasoningGym-v0", **ARITHMETIC)

    def recorded(completions, **kw):
        scored.append(reward(completions=completions, **kw))
        return scored[-1]

    recorded.__name__ = reward.__name__
    trainer = trl.GRPOTrainer(
        model=tiny_model(),
        processing_class=tokenizer,
        reward_funcs=recorded,
        train_dataset=env_dataset("rl2/ReasoningGym-v0", n=4, split="train", **ARITHMETIC),
        args=grpo_config(tmp_path),
    )
    trainer.train()
    assert trainer.state.global_step == 1 and len(scored) == 1 and len(scored[0]) == 4
    logged = trainer.state.log_history[0]
    assert logged["rewards/rl2gem/ReasoningGym-v0/mean"] == pytest.approx(sum(scored[0]) / 4)


class ScriptedLlama(type(tiny_model())):
    """Generation is scripted (the forward passes TRL trains on are the tiny model's): each row's
    text is :meth:`reply` to its prompt, then the end of the turn."""

    tokenizer = None

    def reply(self, prompt: str) -> str:
        raise NotImplementedError

    def generate(self, input_ids=None, attention_mask=None, **kw):
        tok = self.tokenizer
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            text = self.reply(tok.decode(ids[mask.bool()]))
            rows.append(tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")])
        width = max(map(len, rows))
        out = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows], dtype=input_ids.dtype)
        return torch.cat([input_ids, out], dim=1)


class ActingLlama(ScriptedLlama):
    """A Qwen3-style call of the env's ``act`` tool with ``first_guess``, then, once a tool
    response is in the prompt, ``final_guess`` as the final message."""

    first_guess = final_guess = None

    def reply(self, prompt: str) -> str:
        if "<tool_response>" in prompt:
            return f"\\boxed{{{self.final_guess}}}"
        call = {"name": "act", "arguments": {"action": f"\\boxed{{{self.first_guess}}}"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def multi_turn_step(tmp_path, tokenizer, scripted: type[ScriptedLlama], env_id: str, data, seen: list, read):
    """One GRPO step on ``env_id`` through ``env_factory`` with the ``scripted`` model and TRL's
    Qwen3 template (it parses tool calls); ``read(environment)`` of each rollout's environment is
    appended to ``seen`` (a list per reward call) before the reward is computed."""
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.padding_side = "left"
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    model = scripted(tiny_model().config)
    model.load_state_dict(tiny_model().state_dict())
    scripted.tokenizer = tok
    reward = env_reward(env_id)

    def recorded(completions, environments, **kw):
        seen.append((completions, [read(e) for e in environments]))
        return reward(completions=completions, environments=environments, **kw)

    recorded.__name__ = reward.__name__
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=recorded,
        environment_factory=env_factory(env_id),
        train_dataset=data,
        args=grpo_config(tmp_path, max_completion_length=160),  # room for the call, its reply and the answer
    )
    trainer.train()
    assert trainer.state.global_step == 1
    return trainer.state.log_history[0]


def test_one_grpo_step_on_a_multi_turn_env_whose_tool_calls_reach_the_env(tmp_path, tokenizer):
    env_id = "rl2/GuessTheNumber-v0"
    data = env_dataset(env_id, n=1)
    probe = rl2gem.make(env_id)
    probe.reset(seed=data[0]["rl2gem_seed"])
    target = probe.unwrapped.target
    first = 1 if target != 1 else 2
    # the expected reward, played on a fresh env: the tool call's guess, then the final message's
    probe.reset(seed=data[0]["rl2gem_seed"])
    feedback, r1, *_ = probe.step(f"\\boxed{{{first}}}")
    _, r2, terminated, *_ = probe.step(f"\\boxed{{{target}}}")
    assert terminated and r1 + r2 > 0

    ActingLlama.first_guess, ActingLlama.final_guess = first, target
    seen = []
    logged = multi_turn_step(
        tmp_path, tokenizer, ActingLlama, env_id, data.select([0] * 4), seen, lambda e: e.info.get("turn")
    )
    completions, turns = seen[0]
    assert turns == [1] * 4  # the tool call was one env step; the final message is played by the reward
    tool_replies = [m["content"] for c in completions for m in c if m["role"] == "tool"]
    assert len(tool_replies) == 4 and all(feedback in str(t) for t in tool_replies)  # the env's own reply
    assert logged["rewards/rl2gem/GuessTheNumber-v0/mean"] == pytest.approx(r1 + r2)
    assert logged["tools/call_frequency"] > 0


def test_the_environment_tool_stops_at_the_end_of_an_episode():
    tool = EnvironmentTool("rl2/GuessTheNumber-v0", difficulty="easy")
    tool.reset(rl2gem_seed=3)
    target = tool.env.unwrapped.target
    assert "over" in tool.act(f"\\boxed{{{target}}}") and tool.done and tool.total_reward > 0
    assert tool.act("\\boxed{1}").startswith("The episode is over")
    assert tool._finish("\\boxed{2}") == tool.total_reward  # nothing more is played


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return str(a * b)


class Product(rl2gem.Env):
    """What is a * b? One answer in ``\\boxed{}``: reward 1.0 if right."""

    def _reset(self, options):
        self.a, self.b = (int(x) for x in self.np_random.integers(100, 1000, size=2))
        return f"What is {self.a} * {self.b}? Answer in \\boxed{{}}.", {}

    def _step(self, action):
        right = f"\\boxed{{{self.a * self.b}}}" in action
        return ("Right." if right else "Wrong."), float(right), True, False, {}


def product_tools(max_tool_calls: int = 2, tool_prompt: str | None = "append", render_mode: str | None = None):
    product = Product(max_turns=4, render_mode=render_mode)
    return ToolEnvWrapper(product, [FunctionTool(multiply)], max_tool_calls=max_tool_calls, prompt=tool_prompt)


@pytest.fixture
def product_env():
    """``testtrl/Product-v0`` registered for the test only (tests over every registered env must not
    meet it)."""
    rl2gem.register("testtrl/Product-v0", product_tools)
    try:
        yield "testtrl/Product-v0"
    finally:
        del gym.registry["testtrl/Product-v0"]


def test_a_tool_env_s_tools_are_methods_trl_offers_and_each_call_is_an_env_step(product_env):
    """A tool env's own tools went unseen: TRL offered ``act`` (and ``close``), caught the
    model's call of ``multiply`` itself and answered "Tool multiply not found". Each tool is now a
    method, its schema (what TRL builds from it) the tool's, and a call is played as the env's
    action. ``close`` is not offered."""
    from transformers.utils import get_json_schema

    first, second = env_factory(product_env)(), env_factory(product_env)()
    for environment in (first, second):
        offered = sorted(
            n for n in dir(type(environment)) if not n.startswith("_") and n not in ("reset", "get_reward")
        )
        assert [n for n in offered if callable(getattr(type(environment), n))] == ["act", "multiply"]
    schema = get_json_schema(first.multiply)["function"]
    assert schema["name"] == "multiply" and schema["description"] == "Multiply two integers."
    assert schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor."}
    first.reset(rl2gem_seed=5)
    a, b = first.env.unwrapped.a, first.env.unwrapped.b
    assert str(a * b) in first.multiply(a=a, b=b) and first.info["num_tool_calls"] == 1 and not first.done
    assert first._finish(f"\\boxed{{{a * b}}}") == 1.0
    plain = env_factory("rl2/GuessTheNumber-v0")()
    assert type(plain) is EnvironmentTool and not hasattr(plain, "close")


class MultiplyingLlama(ScriptedLlama):
    """A Qwen3-style call of the env's ``multiply`` tool with the task's factors, then, once its
    response is in the prompt, the product as the final answer."""

    def reply(self, prompt: str) -> str:
        if "<tool_response>" in prompt:
            return "\\boxed{" + re.findall(r"<tool_response>\s*(\d+)", prompt)[-1] + "}"
        a, b = map(int, re.findall(r"What is (\d+) \* (\d+)\?", prompt)[-1])
        return f"<tool_call>\n{json.dumps({'name': 'multiply', 'arguments': {'a': a, 'b': b}})}\n</tool_call>"


def test_one_grpo_step_on_a_tool_env_whose_tool_calls_reach_the_env(tmp_path, tokenizer, product_env):
    """The model calls the env's own tool as its prompt says (not through ``act``): TRL calls the
    method, the env runs the tool as an action (its count goes up), and the final answer scores."""
    env_id, seen = product_env, []
    data = env_dataset(env_id, n=2).select([0, 0, 1, 1])
    logged = multi_turn_step(
        tmp_path, tokenizer, MultiplyingLlama, env_id, data, seen, lambda e: e.info["num_tool_calls"]
    )
    assert [calls for _, calls in seen] == [[1, 1, 1, 1]]  # each rollout's call ran in its env
    assert logged["tools/failure_frequency"] == 0 and logged["rewards/rl2gem/Product-v0/mean"] == 1.0


def test_a_split_for_an_env_that_has_none_is_warned_about():
    """``split="test"`` of a seed-only env (a game) made the training tasks again, silently."""
    with pytest.warns(UserWarning, match=r"has no data split: split='test' changes nothing.*seed=100000"):
        held_out = env_dataset("rl2/GuessTheNumber-v0", n=2, split="test")
    assert held_out["rl2gem_seed"] == env_dataset("rl2/GuessTheNumber-v0", n=2)["rl2gem_seed"]
    assert env_dataset("rl2/GuessTheNumber-v0", n=2, seed=100000)["rl2gem_seed"] == [100000, 100001]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env_dataset("rl2/ReasoningGym-v0", n=2, split="test", **ARITHMETIC)
