"""Token-in/token-out episodes: prefix merging with real chat templates, splits where the template rewrites history."""

import asyncio
import threading
import time

import pytest

from rl2gem import Env
from rl2gem.rollout import EnvError, Rollout, RolloutConfig
from rl2gem.rollout.engines.base import Engine, GenerateOutput
from rl2gem.rollout.tito import ChatRenderer, Sequence

THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


class ScriptedEngine(Engine):
    """Answers each request with the next scripted token ids (deterministic, for TITO tests)."""

    def __init__(self, scripts, finish="stop"):
        self.scripts = list(scripts)
        self.finish = finish
        self.calls = []
        self.weight_version = 0

    async def generate(self, input_ids, sampling_params=None, **kw):
        ids = self.scripts[len(self.calls) % len(self.scripts)]
        self.calls.append(list(input_ids))
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        reason = (
            {"type": "stop", "matched": ids[-1]} if self.finish == "stop" else {"type": "length", "length": len(ids)}
        )
        return GenerateOutput(list(ids), lps, reason, len(input_ids), self.weight_version)

    async def pause(self, mode="abort"): ...
    async def resume(self): ...
    async def abort(self, rid=None): ...
    async def update_weights(self, weights, version=None): ...
    async def health(self):
        return True


def episode(tokenizer, scripts, *, chat_template=None, finish="stop", env="rl2/GuessTheNumber-Easy-v0"):
    eng = ScriptedEngine(scripts, finish)

    async def main():
        ro = Rollout(
            eng, tokenizer, env, RolloutConfig(responses_per_prompt=1, max_new_tokens=64), chat_template=chat_template
        )
        batch = await ro.collect(1)
        await ro.close()
        return batch.episodes[0], ro

    ep, ro = asyncio.run(main())
    return ep, eng, ro


def action_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_smollm2_episode_is_one_sequence_equal_to_the_render(tokenizer):
    guesses = [action_ids(tokenizer, f"I guess \\boxed{{{g}}}") for g in (1, 2, 3, 4)]
    ep, eng, ro = episode(tokenizer, guesses)
    assert ep.turns == 4 and len(ep.sequences) == 1 and ep.splits == 0
    seq = ep.sequences[0]
    # every request's input is a prefix of the final sequence: each token processed once
    for call in eng.calls:
        assert seq.input_ids[: len(call)] == call
    # the action tokens are the generated ids, untouched, with their logprobs and rewards on the last token
    acts, lps, pos = [], [], []
    for i, (t, m) in enumerate(zip(seq.input_ids, seq.action_mask, strict=True)):
        if m:
            acts.append(t)
            lps.append(seq.logprobs[i])
            pos.append(i)
    assert acts == [t for g in guesses[: ep.turns] for t in g]
    assert lps == pytest.approx([-0.01 * (i + 1) for g in guesses[: ep.turns] for i in range(len(g))])
    ends = [i for i in pos if i + 1 not in pos]
    assert [seq.rewards[i] for i in ends] == pytest.approx(ep.turn_rewards)
    assert sum(seq.rewards) == pytest.approx(ep.reward)
    # the merged sequence reads exactly like the chat template's rendering of the conversation
    rendered = ChatRenderer(tokenizer).render(ep.messages)
    assert tokenizer.decode(seq.input_ids) + "\n" == rendered


def test_tokens_are_never_retokenised(tokenizer):
    """Non-canonical token ids (one per character) stay as generated."""
    text = "\\boxed{3}"
    odd = [tokenizer.convert_tokens_to_ids(c) for c in text] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert odd != action_ids(tokenizer, text)  # the canonical tokenisation differs
    ep, eng, _ = episode(tokenizer, [odd])
    seq = ep.sequences[0]
    acts = [t for t, m in zip(seq.input_ids, seq.action_mask, strict=True) if m]
    assert acts == odd * ep.turns


def test_truncated_action_gets_the_templates_closing_as_context(tokenizer):
    cut = tokenizer.encode("I think the answer", add_special_tokens=False)  # no end-of-turn token
    ep, _, _ = episode(tokenizer, [cut], finish="length")
    seq = ep.sequences[0]
    first_end = seq.action_mask.index(1) + len(cut)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert seq.input_ids[first_end] == im_end and seq.action_mask[first_end] == 0
    # the last action was cut too: the render closes it, the episode does not need to
    assert tokenizer.decode(seq.input_ids) + "<|im_end|>\n" == ChatRenderer(tokenizer).render(ep.messages)


def test_think_stripping_template_splits_and_counts(tokenizer):
    guesses = [action_ids(tokenizer, f"<think>maybe {g}</think>\\boxed{{{g}}}") for g in (1, 2, 3, 4)]
    ep, eng, ro = episode(tokenizer, guesses, chat_template=THINK_TEMPLATE)
    assert ep.turns >= 2
    assert ep.splits == ep.turns - 1 and len(ep.sequences) == ep.turns
    r = ChatRenderer(tokenizer, THINK_TEMPLATE)
    # each sequence is the render of the conversation up to its turn (earlier thinking stripped) + one action
    for k, seq in enumerate(ep.sequences):
        prompt = [t for t, m in zip(seq.input_ids, seq.action_mask, strict=True) if not m]
        msgs = ep.messages[: 1 + 2 * k]
        assert prompt == r.prompt_ids(msgs)
        assert [t for t, m in zip(seq.input_ids, seq.action_mask, strict=True) if m] == guesses[k]
        assert eng.calls[k] == prompt


# Qwen3's shape: the last assistant turn, when it has no thinking, gets an empty thinking block
# (a render of a finished conversation differs from the generation that made it), earlier ones not
EMPTY_THINK_LAST_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.last and '</think>' not in m['content'] -%}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_a_template_that_renders_only_the_last_turn_otherwise_still_merges(tokenizer):
    """Where the rendered conversation begins with the engine's prompt and the action as sampled,
    the turn merges (it split on every turn under Qwen3's template: the sentinel render of a last
    assistant turn carries an empty thinking block that the conversation does not)."""
    guesses = [action_ids(tokenizer, f"I guess \\boxed{{{g}}}") for g in (1, 2, 3, 4)]
    ep, eng, _ = episode(tokenizer, guesses, chat_template=EMPTY_THINK_LAST_TEMPLATE)
    assert ep.turns == 4 and ep.splits == 0 and len(ep.sequences) == 1
    seq = ep.sequences[0]
    assert all(seq.input_ids[: len(call)] == call for call in eng.calls)
    # each turn's prompt is the template's render of the conversation so far
    r = ChatRenderer(tokenizer, EMPTY_THINK_LAST_TEMPLATE)
    for k, call in enumerate(eng.calls):
        assert call == r.prompt_ids(ep.messages[: 1 + 2 * k])


def test_a_template_that_drops_the_env_s_reply_is_an_error(tokenizer):
    """A template with no ``tool`` role renders nothing of a tool result: the model would act
    without seeing it while the episode's messages recorded it. The delta refuses, naming the role."""
    no_tool_role = (
        "{%- for m in messages -%}{%- if m['role'] != 'tool' -%}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
    )
    r = ChatRenderer(tokenizer, no_tool_role)
    prev = r.initial_messages("Look it up.")
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="does not render the env's 'tool' message"):
        r.delta(prev, "<search>x</search>", [{"role": "tool", "content": "SECRET 42"}], stop)
    assert not r.delta(prev, "<search>x</search>", [{"role": "user", "content": "SECRET 42"}], stop).split
    # Llama 3.x's shape: tool results JSON-encoded (quotes and newlines escaped) are rendered all the same
    json_tool = no_tool_role.replace("m['role'] != 'tool'", "true").replace(
        "+ m['content'] +", "+ (m['content'] | tojson if m['role'] == 'tool' else m['content']) +"
    )
    r = ChatRenderer(tokenizer, json_tool)
    reply = {"role": "tool", "content": '{"temperature": 3}\nsay "hi"'}
    assert r.delta(prev, "<search>x</search>", [reply], stop).ids


def test_renderer_delta_is_the_render_difference(tokenizer):
    r = ChatRenderer(tokenizer, system_prompt="Be brief.")
    prev = r.initial_messages("What is 2+2?")
    d = r.delta(
        prev, "4", [{"role": "user", "content": "Sure?"}], stop_token=tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert not d.split
    ids = r.prompt_ids(prev) + action_ids(tokenizer, "4") + d.ids
    assert tokenizer.decode(ids) == r.render(
        prev + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}], add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(type("T", (), {"chat_template": None})())


def test_a_searchqa_episode_masks_every_retrieved_token(tokenizer):
    """A real multi-turn search episode (the embedded retrieval service): one merged sequence that
    reads as the rendered conversation, in which only the two actions are trainable."""
    import rl2gem

    search = action_ids(tokenizer, "<search>capital of France</search>")
    answer = action_ids(tokenizer, "<answer>Paris</answer>")
    ep, _, _ = episode(tokenizer, [search, answer], env=lambda: rl2gem.make("rl2/SearchQA-v0", topk=2))
    assert ep.turns == 2 and len(ep.sequences) == 1 and ep.splits == 0
    seq = ep.sequences[0]
    assert tokenizer.decode(seq.input_ids) + "\n" == ChatRenderer(tokenizer).render(ep.messages)
    trained = [t for t, m in zip(seq.input_ids, seq.action_mask, strict=True) if m]
    assert trained == search + answer  # nothing the env wrote is trainable
    information = ep.messages[2]["content"]
    assert information.startswith("<information>") and len(tokenizer.encode(information)) > 20
    context = tokenizer.decode([t for t, m in zip(seq.input_ids, seq.action_mask, strict=True) if not m])
    assert information in context  # the retrieved passages are all in the mask-0 part


class RewardEveryTurnEnv(Env):
    """Two turns: reward 1.0 for an action, -0.25 for an empty one (refused as invalid)."""

    invalid_action_reward = -0.25

    def __init__(self):
        super().__init__(max_turns=2)

    def _reset(self, options):
        return "Say anything, twice.", {}

    def _step(self, action):
        return "Again.", 1.0, False, False, {}


def test_an_empty_actions_reward_goes_on_the_previous_action_token(tokenizer):
    first = tokenizer.encode("hello", add_special_tokens=False)
    engine = ScriptedEngine([first, []], finish="length")  # the second turn generates nothing

    async def main():
        rollout = Rollout(engine, tokenizer, RewardEveryTurnEnv, RolloutConfig(responses_per_prompt=1))
        batch = await rollout.collect(1)
        await rollout.close()
        return batch.episodes[0]

    ep = asyncio.run(main())
    assert ep.turn_rewards == [1.0, -0.25] and len(ep.sequences) == 1
    seq = ep.sequences[0]
    last_action = max(i for i, m in enumerate(seq.action_mask) if m)
    assert seq.rewards[last_action] == 0.75 and sum(seq.rewards) == 0.75  # none on a context token
    assert seq.input_ids[last_action] == first[-1]


def test_add_reward_finds_the_last_action_token():
    seq = Sequence()
    seq.extend_context([1, 2])
    assert seq.add_reward(0.5) is None and seq.rewards == [0.0, 0.5]  # no action yet: the last token
    seq.extend_action([3, 4], [-0.1, -0.2], 0)
    seq.extend_context([5, 6])
    seq.add_reward(1.0)
    assert seq.rewards == [0.0, 0.5, 0.0, 1.0, 0.0, 0.0]


def test_a_prompt_over_max_length_ends_the_episode_within_the_limit(tokenizer):
    engine = ScriptedEngine([tokenizer.encode("hello", add_special_tokens=False)])

    async def main():
        config = RolloutConfig(responses_per_prompt=1, max_length=20, max_new_tokens=8)
        rollout = Rollout(engine, tokenizer, "rl2/GuessTheNumber-Easy-v0", config)
        batch = await rollout.collect(1)
        await rollout.close()
        return batch.episodes[0]

    ep = asyncio.run(main())  # GuessTheNumber's prompt is about 100 tokens
    assert ep.truncated and ep.info["truncated_reason"] == "max_length" and engine.calls == []
    [seq] = ep.sequences
    assert len(seq) == 20 and not any(seq.action_mask)  # never a sequence longer than the limit
    assert all(len(getattr(seq, name)) == 20 for name in ("action_mask", "logprobs", "versions", "rewards"))


class SlowStepEnv(Env):
    """Three turns; each step takes 0.2 s in a worker thread. Records a reset or step that starts
    while another call of the same env runs (the env is shared state: that corrupts an episode)."""

    overlaps: list[str] = []

    def __init__(self):
        super().__init__(max_turns=None)
        self.busy = threading.Lock()

    def _reset(self, options):
        if self.busy.locked():
            SlowStepEnv.overlaps.append("reset during a step")
        self.turn_count = 0
        return "Say anything.", {}

    def _step(self, action):
        if not self.busy.acquire(blocking=False):
            SlowStepEnv.overlaps.append("step during a step")
        else:
            time.sleep(0.2)
            self.busy.release()
        self.turn_count += 1
        return "Again.", 1.0, self.turn_count >= 3, False, {}


def test_a_cancelled_episodes_env_is_reused_only_after_its_step_ends(tokenizer):
    """Partial rollouts drop a carried-over group that went stale while its env stepped in a thread:
    the env went back to the pool at once and the next group reset it mid-step (episodes of 2 turns
    where the env plays 3)."""
    SlowStepEnv.overlaps = []
    engine = ScriptedEngine([tokenizer.encode("hi", add_special_tokens=False)], finish="length")
    config = RolloutConfig(
        responses_per_prompt=2, max_new_tokens=4, partial_rollout=True, partial_oversample=1.0, max_staleness=0
    )

    async def main():
        rollout = Rollout(engine, tokenizer, SlowStepEnv, config)
        batches = []
        for _ in range(3):
            batches.append(await rollout.collect(1))
            engine.weight_version += 1  # the carried-over group is stale at the next collect
        await rollout.close()
        return batches

    batches = asyncio.run(main())
    assert sum(batch.metrics["rollout/dropped_stale"] for batch in batches) >= 1
    assert SlowStepEnv.overlaps == []
    assert all(episode.turns == 3 for batch in batches for episode in batch.episodes)


class ExplodingEnv(Env):
    """Seed 0 ends after one turn; other seeds play 6 turns, and seed 1's second step raises once."""

    fired = False
    steps_after_close = 0
    closed = False

    def __init__(self):
        super().__init__(max_turns=None)

    def _reset(self, options):
        self.turn_count, self.turns = 0, 1 if self._episode_seed == 0 else 6
        return "Say anything.", {}

    def _step(self, action):
        ExplodingEnv.steps_after_close += ExplodingEnv.closed
        if self._episode_seed == 1 and self.turn_count == 1 and not ExplodingEnv.fired:
            ExplodingEnv.fired = True
            raise RuntimeError("env exploded")
        time.sleep(0.01)
        self.turn_count += 1
        return "Again.", 1.0, self.turn_count >= self.turns, False, {}


def test_a_group_whose_env_raised_is_dropped_warned_once_and_replaced(tokenizer):
    ExplodingEnv.fired, ExplodingEnv.steps_after_close, ExplodingEnv.closed = False, 0, False
    engine = ScriptedEngine([tokenizer.encode("hi", add_special_tokens=False)], finish="length")

    async def main():
        rollout = Rollout(engine, tokenizer, ExplodingEnv, RolloutConfig(responses_per_prompt=2, max_new_tokens=4))
        with pytest.warns(RuntimeWarning, match=r"(?s)turn 2\) raised RuntimeError: env exploded.*Traceback.*_step"):
            batch = await rollout.collect(2)
        await rollout.close()
        return batch

    batch = asyncio.run(main())
    assert sorted({e.group for e in batch.episodes}) == [0, 2]  # group 1 failed; group 2 took its place
    assert [e.turns for e in batch.episodes] == [1, 1, 6, 6]
    assert batch.metrics["rollout/env_error_groups"] == 1 and batch.metrics["rollout/groups_started"] == 3


class AlwaysExplodingEnv(ExplodingEnv):
    def _reset(self, options):
        if self._episode_seed == 5:
            raise OSError("no such item")
        return super()._reset(options)

    def _step(self, action):
        raise ValueError("broken for good")


def test_more_failed_groups_than_a_collect_takes_is_an_error_and_evaluation_keeps_the_episode(tokenizer):
    engine = ScriptedEngine([tokenizer.encode("hi", add_special_tokens=False)], finish="length")

    async def main():
        rollout = Rollout(
            engine, tokenizer, AlwaysExplodingEnv, RolloutConfig(responses_per_prompt=2, max_new_tokens=4)
        )
        with pytest.warns(RuntimeWarning, match="broken for good"):  # warned once, for three groups
            with pytest.raises(EnvError, match=r"3 groups failed in their env in one collect of 2"):
                await rollout.collect(2)
            played = await rollout.play([(0, None), (5, {"index": 2})])  # evaluation: the episodes are kept
        await rollout.close()
        return played

    played = asyncio.run(main())
    for episode in played:
        assert episode.truncated and episode.info["truncated_reason"] == "env_error" and episode.turns == 0
    assert "astep (seed 0, turn 1) raised ValueError: broken for good" in played[0].info["error"]
    assert "areset (seed 5) raised OSError: no such item" in played[1].info["error"]
    assert (played[1].info["seed"], played[1].info["index"]) == (5, 2)  # the item, for paired comparisons


def test_an_env_error_cancels_its_group_and_keeps_the_finished_ones(tokenizer):
    ExplodingEnv.fired, ExplodingEnv.steps_after_close, ExplodingEnv.closed = False, 0, False
    engine = ScriptedEngine([tokenizer.encode("hi", add_special_tokens=False)], finish="length")

    async def main():
        config = RolloutConfig(responses_per_prompt=2, max_new_tokens=4, env_errors="raise")
        rollout = Rollout(engine, tokenizer, ExplodingEnv, config)
        with pytest.raises(EnvError, match=r"astep \(seed 1, turn 2\) raised RuntimeError: env exploded"):
            await rollout.collect(2)
        calls = len(engine.calls)
        batch = await rollout.collect(1)  # group 0 finished in the failed call: returned now
        assert len(engine.calls) == calls and batch.metrics["rollout/groups_started"] == 0
        await rollout.close()
        ExplodingEnv.closed = True
        await asyncio.sleep(0.3)
        return batch

    batch = asyncio.run(main())
    assert [e.group for e in batch.episodes] == [0, 0] and all(e.turns == 1 for e in batch.episodes)
    assert ExplodingEnv.steps_after_close == 0  # the failed group's other episode was stopped


def test_an_engine_reporting_an_old_version_is_an_error_not_an_endless_collect(tokenizer):
    """Partial rollouts start groups until enough are fresh: an engine whose answers all carry
    version 0 (a server that reports none) made every group stale and collect() never returned."""
    from rl2gem.rollout.engines.base import EngineError
    from rl2gem.rollout.engines.http import parse_generate_response

    class OldVersionEngine(ScriptedEngine):
        async def generate(self, input_ids, sampling_params=None, **kw):
            out = await super().generate(input_ids, sampling_params, **kw)
            return GenerateOutput(out.output_ids, out.output_logprobs, out.finish_reason, out.prompt_tokens, 0)

    engine = OldVersionEngine([tokenizer.encode("hi", add_special_tokens=False)], finish="length")
    engine.weight_version = 5
    config = RolloutConfig(responses_per_prompt=2, max_new_tokens=4, partial_rollout=True, max_staleness=1)

    async def main():
        rollout = Rollout(engine, tokenizer, "rl2/GuessTheNumber-Easy-v0", config)
        try:
            with pytest.raises(EngineError, match="version 0 while the engine is at version 5"):
                await asyncio.wait_for(rollout.collect(1), 30)
        finally:
            await rollout.close()

    asyncio.run(main())
    # HTTPEngine's answers without a version carry the version the request was sent at
    answer = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}
    assert parse_generate_response(answer, 3, weight_version=4).weight_version == 4
    assert parse_generate_response({**answer, "meta_info": {"weight_version": "2"}}, 3, 4).weight_version == 2


class SecondRequestHeldEngine(ScriptedEngine):
    """The first request answers at once. The second is held: ``cut=True``, until a pause, which
    aborts it (a running request); ``cut=False``, until resume (a queued one: Engine.pause's
    contract leaves those alone)."""

    def __init__(self, scripts, cut: bool):
        super().__init__(scripts, finish="length")
        self.cut, self.released = cut, asyncio.Event()

    async def generate(self, input_ids, sampling_params=None, **kw):
        out = await super().generate(input_ids, sampling_params, **kw)
        if len(self.calls) == 2:
            await self.released.wait()
            if self.cut:
                return GenerateOutput([], [], {"type": "abort", "message": "paused"}, len(input_ids), 0)
        return out

    async def pause(self, mode="abort"):
        if self.cut:
            self.released.set()

    async def resume(self):
        if not self.cut:
            self.released.set()


def two_partial_collects(tokenizer, cut: bool):
    """Two partial-rollout collects of one group (one more in flight) over a
    :class:`SecondRequestHeldEngine`: their batches and the first one's seconds."""
    engine = SecondRequestHeldEngine([tokenizer.encode("hi", add_special_tokens=False)], cut)
    config = RolloutConfig(responses_per_prompt=1, max_new_tokens=4, partial_rollout=True, partial_oversample=1.0)

    async def main():
        rollout = Rollout(engine, tokenizer, RewardEveryTurnEnv, config)
        start = time.monotonic()
        first = await rollout.collect(1)
        seconds = time.monotonic() - start
        second = await rollout.collect(1)
        await rollout.close()
        return first, second, seconds

    return asyncio.run(main())


def test_the_requests_a_collects_pause_cuts_count_in_that_collect(tokenizer):
    """rollout/aborted_requests: the requests cut by the pause that ends a partial-rollout collect
    answer after it, and were counted in the next collect's metrics (or in none)."""
    first, second, _ = two_partial_collects(tokenizer, cut=True)
    assert first.metrics["rollout/aborted_requests"] == 1.0 and second.metrics["rollout/aborted_requests"] == 0.0


def test_a_request_queued_at_the_pause_does_not_hold_the_collect(tokenizer):
    """A pause in abort mode cuts running requests; queued ones wait for resume (Engine.pause's
    contract). Waiting for every request out to answer stalled each collect for 5 s."""
    _, _, seconds = two_partial_collects(tokenizer, cut=False)
    assert seconds < 2.0


class BudgetEngine(ScriptedEngine):
    """A scripted engine that keeps to the request's ``max_new_tokens`` (finish ``length`` when it cuts)."""

    async def generate(self, input_ids, sampling_params=None, **kw):
        ids = self.scripts[len(self.calls) % len(self.scripts)][: sampling_params.max_new_tokens]
        full = len(self.scripts[len(self.calls) % len(self.scripts)])
        self.calls.append(list(input_ids))
        reason = {"type": "stop", "matched": ids[-1]} if len(ids) == full else {"type": "length", "length": len(ids)}
        return GenerateOutput(list(ids), [-0.1] * len(ids), reason, len(input_ids), self.weight_version)


def test_an_action_the_episodes_token_budget_cuts_is_not_played(tokenizer):
    """With 5 tokens of ``max_length`` left the second action was cut to a fragment, which the env
    then scored as an invalid move (a guess the model did not make). The env never sees it now: the
    episode ends truncated (``max_length``), the fragment kept as the action it trained on."""
    scripts = [action_ids(tokenizer, r"\boxed{5}"), action_ids(tokenizer, r"My guess is \boxed{7} because 5 was low")]

    def play(max_length):
        engine = BudgetEngine(scripts)

        async def main():
            config = RolloutConfig(responses_per_prompt=1, max_length=max_length, max_new_tokens=64)
            rollout = Rollout(engine, tokenizer, "rl2/GuessTheNumber-v0", config)
            batch = await rollout.collect(1)
            await rollout.close()
            return batch.episodes[0]

        return asyncio.run(main()), engine

    _, engine = play(4096)
    ep, engine = play(len(engine.calls[1]) + 5)
    assert len(engine.calls) == 2 and ep.turns == 1 and ep.finish_reasons == ["stop", "length"]
    assert ep.truncated and ep.info["truncated_reason"] == "max_length" and ep.info["num_invalid_actions"] == 0
    [sequence] = ep.sequences
    assert sequence.action_mask[-5:] == [1] * 5 and len(sequence) == len(engine.calls[1]) + 5


def test_tools_in_the_template_are_not_also_written_into_the_envs_text(tokenizer):
    """``tools_in_template=True`` renders the tool schemas in the system turn: an env id given to
    Rollout wrote them into its prompt too (the command lines set ``tool_prompt=None``, Rollout did
    not); an explicit ``tool_prompt`` that still writes them is warned about."""

    def first_prompt(env_kwargs):
        engine = ScriptedEngine([action_ids(tokenizer, r"\boxed{1}")])

        async def main():
            config = RolloutConfig(responses_per_prompt=1, max_new_tokens=16, tools_in_template=True)
            rollout = Rollout(
                engine, tokenizer, "rl2/PythonMath-v0", config, chat_template="chatml_tools", env_kwargs=env_kwargs
            )
            await rollout.collect(1)
            await rollout.close()

        asyncio.run(main())
        return tokenizer.decode(engine.calls[0])

    assert first_prompt({}).count('"name": "python"') == 1
    with pytest.warns(UserWarning, match="the tool schemas are rendered twice"):
        assert first_prompt({"tool_prompt": "append"}).count('"name": "python"') > 1
