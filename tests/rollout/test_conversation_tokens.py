"""ChatRenderer.conversation: a whole conversation as the one TITO sequence a Rollout would have built."""

import asyncio

import pytest
from helpers import masked_runs
from test_tito import THINK_TEMPLATE, ScriptedEngine, action_ids
from toy_envs import CountEnv, SlowSearchEnv

from rl2gem import Env
from rl2gem.rollout import Rollout, RolloutConfig
from rl2gem.rollout.tito import ChatRenderer

CONVERSATION = [
    {"role": "system", "content": "You are a terse calculator."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "That makes 12."},
]


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_masked_tokens_are_the_assistant_turns_and_the_text_is_the_render(tokenizer):
    renderer = ChatRenderer(tokenizer)
    sequence = renderer.conversation(CONVERSATION)
    n = len(sequence.input_ids)
    assert len(sequence.action_mask) == len(sequence.logprobs) == len(sequence.versions) == len(sequence.rewards) == n
    assert sequence.logprobs == [0.0] * n and sequence.versions == [-1] * n and sequence.rewards == [0.0] * n
    runs = masked_runs(sequence.input_ids, sequence.action_mask)
    assert [decode(tokenizer, run) for run in runs] == ["2+2 is 4.<|im_end|>", "That makes 12.<|im_end|>"]
    # the stop token is the tokenizer's eos, <|im_end|>, and the last token of every action
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end and all(run[-1] == im_end for run in runs)
    # the whole sequence reads as the template's render; the template also closes the last turn
    # with "<|im_end|>\n", the sequence stops at that <|im_end|>: exactly one "\n" differs, at the end
    rendered = renderer.render(CONVERSATION)
    assert rendered.endswith("That makes 12.<|im_end|>\n")
    assert decode(tokenizer, sequence.input_ids) + "\n" == rendered


def test_prompt_is_the_generation_prompt_of_the_first_messages(tokenizer):
    renderer = ChatRenderer(tokenizer)
    sequence = renderer.conversation(CONVERSATION)
    first_action = sequence.action_mask.index(1)
    expected = tokenizer.encode(
        "<|im_start|>system\nYou are a terse calculator.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    assert sequence.input_ids[:first_action] == expected


def test_explicit_stop_token_ends_each_assistant_turn(tokenizer):
    renderer = ChatRenderer(tokenizer)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext != tokenizer.eos_token_id
    sequence = renderer.conversation(CONVERSATION, stop_token=endoftext)
    runs = masked_runs(sequence.input_ids, sequence.action_mask)
    assert [run[-1] for run in runs] == [endoftext, endoftext]
    assert [decode(tokenizer, run[:-1]) for run in runs] == ["2+2 is 4.", "That makes 12."]


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    renderer = ChatRenderer(tokenizer, THINK_TEMPLATE)
    thinking = [
        {"role": "user", "content": "Guess."},
        {"role": "assistant", "content": "<think>maybe 3</think>\\boxed{3}"},
        {"role": "user", "content": "Higher."},
        {"role": "assistant", "content": "\\boxed{4}"},
    ]
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        renderer.conversation(thinking)
    # a single turn has nothing earlier to rewrite
    assert sum(renderer.conversation(thinking[:2]).action_mask) > 0


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}], "starts with an assistant turn"),
        ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], "role 'robot'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "non-string content"),
        ([{"role": "user"}, {"role": "assistant", "content": "x"}], "message 0"),
    ],
)
def test_bad_conversations_are_rejected(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        ChatRenderer(tokenizer).conversation(messages)


class TwoResultToolEnv(Env):
    """Each call step returns two tool results (one ``role="tool"`` message each); ``done`` ends."""

    def _reset(self, options):
        return "Call the tools, then say done.", {}

    def _step(self, action):
        if action.strip() == "done":
            return "", 1.0, True, False, {}
        results = [f"result A of {action}", f"result B of {action}"]
        return "\n".join(results), 0.0, False, False, {"role": "tool", "tool_results": results}


def play(tokenizer, env_factory, texts, system_prompt=None):
    engine = ScriptedEngine([action_ids(tokenizer, text) for text in texts])

    async def main():
        config = RolloutConfig(responses_per_prompt=1, max_new_tokens=64, system_prompt=system_prompt)
        rollout = Rollout(engine, tokenizer, env_factory, config)
        try:
            return (await rollout.play([(7, None)]))[0]
        finally:
            await rollout.close()

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("env_factory", "texts", "system_prompt", "roles"),
    [
        # user replies, with a system prompt; the goal (3..5) comes from the seed
        (lambda: CountEnv(max_turns=10), ["1", "2", "3", "4", "5"], "Count carefully.", None),
        # tool replies: <search>, <search>, <answer>
        (
            lambda: SlowSearchEnv(latency=0.0),
            ["<search>a</search>", "<search>b</search>", "<answer>5</answer>"],
            None,
            ["user", "assistant", "tool", "assistant", "tool", "assistant"],
        ),
        # two tool results per step: two consecutive tool messages
        (
            TwoResultToolEnv,
            ["call x", "call y", "done"],
            None,
            ["user", "assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"],
        ),
    ],
)
def test_same_tokens_as_a_rollout_of_the_same_actions(tokenizer, env_factory, texts, system_prompt, roles):
    episode = play(tokenizer, env_factory, texts, system_prompt)
    assert episode.terminated and episode.splits == 0 and len(episode.sequences) == 1
    if roles is not None:
        assert [m["role"] for m in episode.messages] == roles
    if system_prompt is not None:
        assert episode.messages[0] == {"role": "system", "content": system_prompt}
    played = episode.sequences[0]
    sequence = ChatRenderer(tokenizer).conversation(episode.messages)
    assert sequence.input_ids == played.input_ids
    assert sequence.action_mask == played.action_mask
    assert [decode(tokenizer, run) for run in masked_runs(sequence.input_ids, sequence.action_mask)] == [
        text + "<|im_end|>" for text in texts[: episode.turns]
    ]
