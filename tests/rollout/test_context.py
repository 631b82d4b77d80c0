"""Managed context (rollout.context): segments that are exactly what the engine saw, the policies'
choices of history, and log-probs the trainer reproduces."""

import asyncio

import pytest
import torch
from tiny import tiny_model

from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig
from rl2gem.rollout.context import CONTINUE_PROMPT, CUT_MARKER, SUMMARY_PROMPT, ContextConfig, truncated_messages
from rl2gem.training.forward import token_logprobs

ENV = "rl2/GuessTheNumber-Easy-v0"  # 4 turns; the random tiny model never answers validly


class RecordingEngine(EmbeddedEngine):
    """The embedded engine, recording the token ids of every generate call."""

    def __init__(self, model):
        super().__init__(model)
        self.inputs, self.seeds = [], []

    async def generate(self, input_ids, sampling_params=None, **kwargs):
        self.inputs.append(list(input_ids))
        self.seeds.append(sampling_params.sampling_seed)
        return await super().generate(input_ids, sampling_params, **kwargs)


def play(tokenizer, context: ContextConfig, model=None, episodes: int = 2, chat_template=None, max_length=2048):
    """A group of GuessTheNumber-Easy episodes: a prompt of 83 tokens, then 4 turns of 8 action
    tokens and a 23-token reply each (184 tokens in one sequence without a context budget)."""

    async def main():
        engine = RecordingEngine(model or tiny_model())
        config = RolloutConfig(
            responses_per_prompt=episodes, max_new_tokens=8, seed=3, context=context, max_length=max_length
        )
        rollout = Rollout(engine, tokenizer, ENV, config, chat_template=chat_template)
        batch = await rollout.collect(1)
        await rollout.close()
        await engine.close()
        # each request samples from its own seed (a summary and the action after it included)
        assert None not in engine.seeds and len(set(engine.seeds)) == len(engine.seeds)
        return batch, engine.inputs

    return asyncio.run(main())


def test_truncation_keeps_the_task_and_the_latest_whole_turns():
    task = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    turns = [
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "r1"},
        {"role": "assistant", "content": "a2"},
        {"role": "tool", "content": "t2"},
        {"role": "tool", "content": "t2b"},
        {"role": "assistant", "content": "a3"},
        {"role": "user", "content": "r3"},
    ]

    def length(messages):
        return len(messages)

    assert truncated_messages(task + turns, 2, length, 9) == task + turns
    assert truncated_messages(task + turns, 2, length, 8) == task + turns[2:]  # a2 with both tool replies
    assert truncated_messages(task + turns, 2, length, 5) == task + turns[5:]
    assert truncated_messages(task + turns, 2, length, 4) == task + turns[5:]
    assert truncated_messages(task + turns, 2, length, 3) is None  # not even the last turn, its reply empty

    # counted in characters: task 5, turn a1 r1 4, turn a2 + a 10-character reply 12
    def characters(messages):
        return sum(len(m["content"]) for m in messages)

    reply = {"role": "tool", "content": "0123456789", "name": "search"}
    long_turn = task + turns[:3] + [reply]
    assert truncated_messages(long_turn, 2, characters, 21) == long_turn
    assert truncated_messages(long_turn, 2, characters, 17) == task + long_turn[4:]
    # 14: the last turn alone does not fit, so its reply keeps its head: 5 + 2 + 1 + len(" [...]") = 14
    assert truncated_messages(long_turn, 2, characters, 14) == task + [turns[2], {**reply, "content": "0 [...]"}]
    assert truncated_messages(long_turn, 2, characters, 12) is None  # not even an empty head: 13
    with pytest.raises(ValueError, match="policy"):
        ContextConfig(max_tokens=100, policy="forget")
    with pytest.raises(ValueError, match="not context settings"):
        ContextConfig.from_value({"max_token": 100})
    assert RolloutConfig.from_mapping({"context": {"max_tokens": 512}}).context == ContextConfig(max_tokens=512)


def _segments_are_what_the_engine_saw(batch, inputs):
    """Every generate call's input is a prefix of one segment, followed there by that action's
    tokens; every segment's action tokens are accounted for by those calls."""
    for episode in batch.episodes:
        for sequence in episode.sequences:
            starts = [
                i for i, m in enumerate(sequence.action_mask) if m and (i == 0 or not sequence.action_mask[i - 1])
            ]
            for start in starts:
                assert sequence.input_ids[:start] in inputs, "an action generated from tokens the engine never saw"


def test_truncate_starts_segments_from_the_task_and_the_latest_turns(tokenizer):
    # 140 tokens: turn 3 (at 145) does not fit; the task and turn 2 (83 + 31) and an action do
    batch, inputs = play(tokenizer, ContextConfig(max_tokens=140, policy="truncate"))
    _segments_are_what_the_engine_saw(batch, inputs)
    for episode in batch.episodes:
        assert episode.turns == 4 and episode.segments == 2 and episode.summaries == 0
        assert len(episode.sequences) == 1 + episode.segments
        first = episode.sequences[0]
        task_ids = first.input_ids[: first.action_mask.index(1)]
        assert len(task_ids) == 83
        for sequence in episode.sequences:
            assert len(sequence) <= 140
            assert sum(sequence.action_mask) in (8, 16)  # one or two turns per segment
        for sequence in episode.sequences[1:]:
            text = tokenizer.decode(sequence.input_ids)
            assert tokenizer.decode(task_ids).split("<|im_start|>user")[1] in text  # the task is kept
            assert sequence.action_mask[: len(task_ids)] == [0] * len(task_ids)
    assert batch.metrics["rollout/context_segments"] >= 1


# ChatML with a blank line after every message but the last: every turn rewrites the one before
REWRITING_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- if not loop.last -%}{{ '\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_the_context_budget_holds_where_every_turn_splits_the_sequence(tokenizer):
    """A template that rewrites earlier turns starts a new sequence each turn (the whole
    conversation rendered again): its length still goes through ``context.max_tokens``, so no
    request exceeds the budget (the check once ran only on merged turns, and the prompts grew to
    the whole episode)."""
    batch, inputs = play(tokenizer, ContextConfig(max_tokens=140, policy="truncate"), chat_template=REWRITING_TEMPLATE)
    for episode in batch.episodes:
        assert episode.turns == 4 and episode.splits >= 1 and episode.segments >= 1
    assert max(len(ids) for ids in inputs) + 8 <= 140


@pytest.mark.parametrize("max_length", [2048, 110])
def test_truncate_cuts_a_reply_that_does_not_fit_with_the_task_alone(tokenizer, max_length):
    """110 tokens: the task (83), one action (8) and its 23-token reply leave no room for the next
    action, so every new segment keeps the reply's head and :data:`CUT_MARKER`; the episode still
    plays its 4 turns (it once ended at the first reply, truncated), also where the reply would
    take the sequence past ``max_length`` (a new segment, not the end of the episode)."""
    batch, inputs = play(tokenizer, ContextConfig(max_tokens=110, policy="truncate"), max_length=max_length)
    _segments_are_what_the_engine_saw(batch, inputs)
    for episode in batch.episodes:
        assert episode.turns == 4 and episode.segments == 3 and episode.info["truncated_reason"] == "max_turns"
        for sequence in episode.sequences:
            assert len(sequence) <= 110
        for sequence in episode.sequences[1:]:
            prompt = sequence.input_ids[: sequence.action_mask.index(1)]
            assert len(prompt) + 8 <= 110 and CUT_MARKER in tokenizer.decode(prompt)


def test_summarize_trains_the_summary_and_continues_from_it(tokenizer):
    batch, inputs = play(tokenizer, ContextConfig(max_tokens=140, policy="summarize", summary_max_new_tokens=6))
    _segments_are_what_the_engine_saw(batch, inputs)
    for episode in batch.episodes:
        assert episode.turns == 4 and episode.summaries == episode.segments >= 1
        # each segment but the last ends with a summary; per-turn credit counts it in the next turn
        assert [sequence.summary for sequence in episode.sequences] == [True] * episode.summaries + [False]
        for old, new in zip(episode.sequences, episode.sequences[1:], strict=False):
            summary_length = old.action_mask[::-1].index(0)  # the old segment ends with the summary
            assert 1 <= summary_length <= 6
            summary = tokenizer.decode(old.input_ids[-summary_length:], skip_special_tokens=True)
            asked = tokenizer.decode(old.input_ids[:-summary_length])
            assert asked.rstrip().endswith("<|im_start|>assistant") and SUMMARY_PROMPT in asked
            # the new segment starts with the chat template's rendering of the task, the summary
            # and the request to go on (rendered here by the tokenizer itself)
            conversation = [
                episode.messages[0],
                {"role": "assistant", "content": summary},
                {"role": "user", "content": CONTINUE_PROMPT},
            ]
            prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert new.input_ids[: len(expected)] == expected and new.action_mask[: len(expected)] == [0] * len(
                expected
            )
    assert batch.metrics["rollout/summaries"] >= 1


def test_the_trainer_recomputes_each_segments_logprobs(tokenizer):
    model = tiny_model()
    batch, _ = play(tokenizer, ContextConfig(max_tokens=140, policy="summarize", summary_max_new_tokens=6), model)
    sequences = batch.sequences
    assert len(sequences) > len(batch.episodes)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, [s.input_ids for s in sequences], torch.device("cpu"))
    start = 0
    for s in sequences:
        got = logprobs[start : start + len(s)]
        want = torch.tensor(s.logprobs)
        mask = torch.tensor(s.action_mask, dtype=torch.bool)
        assert torch.allclose(got[mask], want[mask], atol=1e-4), (got[mask] - want[mask]).abs().max()
        start += len(s)


def test_summarize_falls_back_to_truncate_where_the_summary_leaves_no_room(tokenizer):
    """A long summary: the task, the summary and the request to go on would leave no room for an
    action within max_tokens, so the segment is the truncate policy's (the summary stays trained)."""
    batch, inputs = play(tokenizer, ContextConfig(max_tokens=112, policy="summarize", summary_max_new_tokens=40))
    _segments_are_what_the_engine_saw(batch, inputs)
    assert batch.metrics["rollout/summaries"] >= 1
    for episode in batch.episodes:
        for sequence in episode.sequences[1:]:
            prompt = sequence.input_ids[: sequence.action_mask.index(1)]
            assert len(prompt) + 8 <= 112 and CONTINUE_PROMPT not in tokenizer.decode(prompt)


def test_a_context_limit_below_the_first_prompt_is_warned_about_and_one_below_an_action_refused(tokenizer):
    with pytest.raises(ValueError, match="context.max_tokens=64 leaves no room for a prompt beside an action of"):
        RolloutConfig(max_new_tokens=64, context={"max_tokens": 64})
    with pytest.warns(UserWarning, match=r"rollout.context.max_tokens=40 is less than an episode's first prompt"):
        batch, _ = play(tokenizer, ContextConfig(max_tokens=40, policy="truncate"))
    for episode in batch.episodes:
        assert episode.turns == 1 and episode.info["truncated_reason"] == "context"
