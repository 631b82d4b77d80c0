"""Group rollouts, dynamic filtering, partial rollouts across pause/resume and weight updates."""

import asyncio

import pytest
from tiny import tiny_model
from toy_envs import SeedParityEnv, SlowSearchEnv

from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig, merge_rank_metrics

ENV = "rl2/GuessTheNumber-Easy-v0"  # 4 turns; the random tiny model never answers validly


def test_groups_share_their_initial_state_and_record_everything(tokenizer):
    async def main():
        eng = EmbeddedEngine(tiny_model())
        ro = Rollout(
            eng, tokenizer, ENV, RolloutConfig(responses_per_prompt=3, max_new_tokens=8, concurrency=5, seed=7)
        )
        batch = await ro.collect(3)
        await ro.close()
        await eng.close()
        return batch

    batch = asyncio.run(main())
    assert len(batch.groups) == 3 and all(len(g) == 3 for g in batch.groups)
    prompts = []
    for g in batch.groups:
        first = {tuple(e.sequences[0].input_ids[: e.sequences[0].action_mask.index(1)]) for e in g}
        assert len(first) == 1  # same initial observation in a group
        prompts.append(first.pop())
        assert len({e.group for e in g}) == 1
    for e in batch.episodes:
        s = e.sequences[0]
        assert len(s.input_ids) == len(s.action_mask) == len(s.logprobs) == len(s.versions) == len(s.rewards)
        assert e.turns == 4 and e.truncated and len(e.finish_reasons) == 4
        assert all(v == 0 for v, m in zip(s.versions, s.action_mask, strict=True) if m)
        assert all(lp <= 0 for lp, m in zip(s.logprobs, s.action_mask, strict=True) if m)
        assert e.num_action_tokens == 4 * 8
    m = batch.metrics
    assert m["rollout/episodes"] == 9 and m["rollout/requests"] == 36 and m["rollout/response_length"] == 32
    assert m["rollout/splits"] == 0 and m["rollout/sequences"] == 9


def test_groups_get_different_tasks(tokenizer):
    async def main():
        eng = EmbeddedEngine(tiny_model())
        ro = Rollout(eng, tokenizer, "rl2/Countdown-v0", RolloutConfig(responses_per_prompt=2, max_new_tokens=4))
        batch = await ro.collect(4)
        await ro.close()
        await eng.close()
        return batch

    batch = asyncio.run(main())
    prompts = [
        {tuple(e.sequences[0].input_ids[: e.sequences[0].action_mask.index(1)]) for e in g} for g in batch.groups
    ]
    assert all(len(p) == 1 for p in prompts)
    assert len(set().union(*prompts)) == 4


def test_max_length_truncates_the_episode(tokenizer):
    async def main():
        eng = EmbeddedEngine(tiny_model())
        ro = Rollout(eng, tokenizer, ENV, RolloutConfig(responses_per_prompt=1, max_new_tokens=64, max_length=200))
        batch = await ro.collect(1)
        await ro.close()
        await eng.close()
        return batch.episodes[0]

    ep = asyncio.run(main())
    assert ep.truncated and ep.info.get("truncated_reason") == "max_length"
    assert len(ep.sequences[0]) <= 200  # a reply past it is not appended


def test_dynamic_filter_drops_equal_reward_groups(tokenizer):
    async def main():
        eng = EmbeddedEngine(tiny_model())
        cfg = RolloutConfig(responses_per_prompt=2, max_new_tokens=4, dynamic_filter=True, max_groups_factor=2)
        ro = Rollout(eng, tokenizer, ENV, cfg)
        batch = await ro.collect(2)
        await ro.close()
        await eng.close()
        return batch

    batch = asyncio.run(main())
    # the random model loses every game: every group has equal rewards and is filtered
    assert batch.groups == []
    assert batch.metrics["rollout/filtered_ratio"] == 1.0 and batch.metrics["rollout/groups_started"] == 4
    # no kept episode: no episode means (a missing value, not a zero reward); the 8 episodes of
    # the 4 filtered groups are the reward before filtering
    assert not {"rollout/reward", "rollout/success", "rollout/response_length", "rollout/turns"} & set(batch.metrics)
    assert batch.metrics["rollout/unfiltered_episodes"] == 8 and batch.metrics["rollout/unfiltered_reward"] == 0.0


@pytest.mark.parametrize("dynamic_filter", [True, False])
def test_unfiltered_reward_is_the_mean_before_dynamic_filtering(tokenizer, dynamic_filter):
    """Group seeds 0, 1, 2, 3 (``seed=0``): SeedParityEnv pays 1 to the two even-seeded groups, so
    the mean over the 8 episodes before filtering is 0.5 whether or not the filter keeps them."""

    async def main():
        eng = EmbeddedEngine(tiny_model())
        cfg = RolloutConfig(
            responses_per_prompt=2, max_new_tokens=4, dynamic_filter=dynamic_filter, max_groups_factor=2
        )
        ro = Rollout(eng, tokenizer, SeedParityEnv, cfg)
        batch = await ro.collect(2 if dynamic_filter else 4)
        await ro.close()
        await eng.close()
        return batch

    metrics = asyncio.run(main()).metrics
    assert metrics["rollout/groups_started"] == 4 and metrics["rollout/unfiltered_episodes"] == 8
    assert metrics["rollout/unfiltered_reward"] == 0.5
    if dynamic_filter:  # every group scored alike: none kept
        assert metrics["rollout/groups"] == 0 and "rollout/reward" not in metrics
    else:
        assert metrics["rollout/groups"] == 4 and metrics["rollout/reward"] == 0.5


def test_dynamic_filter_compares_the_rewards_trained_on(tokenizer):
    """``filter_rewards`` (a trainer's reward objectives): SeedParityEnv pays each group's two
    episodes alike, so the env's rewards drop every group, while rewards that differ within each
    group keep them all, and the episodes keep their env rewards (the trainer shapes them after)."""
    seen = []

    def trained(episodes):
        seen.append(len(episodes))
        return [e.reward + index for index, e in enumerate(episodes)]

    async def main(filter_rewards):
        eng = EmbeddedEngine(tiny_model())
        cfg = RolloutConfig(responses_per_prompt=2, max_new_tokens=4, dynamic_filter=True, max_groups_factor=2)
        ro = Rollout(eng, tokenizer, SeedParityEnv, cfg, filter_rewards=filter_rewards)
        batch = await ro.collect(2)
        await ro.close()
        await eng.close()
        return batch

    dropped, kept = asyncio.run(main(None)), asyncio.run(main(trained))
    assert dropped.groups == [] and dropped.metrics["rollout/filtered_ratio"] == 1.0
    assert len(kept.groups) == 2 and kept.metrics["rollout/groups_started"] == 2 and seen == [2, 2]
    assert sorted(e.reward for e in kept.episodes) == [0.0, 0.0, 1.0, 1.0]  # groups 0 and 1: env rewards


def test_group_reward_variance_metrics_by_hand(tokenizer):
    """rollout/zero_variance_groups (groups a group baseline gives zero advantage) and
    rollout/group_reward_std on three hand-made groups."""
    from collections import Counter
    from types import SimpleNamespace

    def group(*rewards):
        fields = dict(num_action_tokens=1, turns=1, num_tokens=2, sequences=[None], splits=0, truncated=False)
        fields.update(segments=0, summaries=0, info={})
        return [SimpleNamespace(reward=r, **fields) for r in rewards]

    ro = Rollout(EmbeddedEngine(tiny_model()), tokenizer, ENV, RolloutConfig(responses_per_prompt=2))
    m = ro._metrics([group(1.0, 1.0), group(0.0, 1.0), group(0.0, 0.0)], Counter(), Counter(), 3, 0.0)
    assert m["rollout/zero_variance_groups"] == pytest.approx(2 / 3)
    assert m["rollout/group_reward_std"] == pytest.approx(0.5 / 3)  # population std of (0, 1) is 0.5
    alone = ro._metrics([group(1.0)], Counter(), Counter(), 1, 0.0)  # no group with a baseline
    assert alone["rollout/reward"] == 1.0 and "rollout/zero_variance_groups" not in alone


def test_partial_rollouts_keep_every_token_across_pause_and_weight_update(tokenizer):
    max_new = 48

    async def main():
        eng = EmbeddedEngine(tiny_model(), max_batch_size=8)
        cfg = RolloutConfig(
            responses_per_prompt=2,
            max_new_tokens=max_new,
            partial_rollout=True,
            partial_oversample=1.0,
            max_staleness=1,
            concurrency=3,
        )
        ro = Rollout(eng, tokenizer, ENV, cfg)
        first = await ro.collect(2)
        carried = len(ro._inflight)
        paused = eng.paused
        await eng.update_weights(tiny_model(seed=1).state_dict())
        second = await ro.collect(2)
        third = await ro.collect(2)
        # drain: requests that slipped into the engine's queue as it paused run now
        await eng.resume()
        while eng.load()["num_reqs"]:
            await asyncio.sleep(0.01)
        stats = dict(eng.stats)
        left = len(ro._inflight) + len(ro._ready)
        await ro.close()
        await eng.close()
        return first, carried, paused, second, third, stats, left, ro

    # Whether a pause finds requests mid-action is up to thread timing (on a loaded machine the
    # engine can finish every in-flight turn before the event loop pauses it): up to 3 tries.
    for _ in range(3):
        first, carried, paused, second, third, stats, left, ro = asyncio.run(main())
        assert paused and carried > 0 and first.metrics["rollout/in_flight_after"] == carried
        assert second.metrics["rollout/carried_over"] == carried
        # no request lost: every request the rollout sent came back (finished or aborted by the pause)
        assert stats["requests"] == stats["finished"] == ro.stats["requests"]
        assert ro.stats["aborted_requests"] == stats.get("finish_abort", 0)
        if ro.stats["aborted_requests"] > 0:  # the pauses cut some actions
            break
    else:
        pytest.fail("no pause in 3 runs cut an action")
    batches = [first, second, third]
    # no token lost or duplicated: every action of the never-stopping model has exactly max_new tokens
    for b in batches:
        for e in b.episodes:
            s = e.sequences[0]
            runs, n = [], 0
            for m in s.action_mask + [0]:
                if m:
                    n += 1
                elif n:
                    runs.append(n)
                    n = 0
            assert runs == [max_new] * e.turns
    # every group started is accounted for: returned, dropped as stale, or still in flight
    started = sum(b.metrics["rollout/groups_started"] for b in batches)
    returned = sum(len(b.groups) for b in batches)
    dropped = sum(b.metrics["rollout/dropped_stale"] for b in batches)
    assert started == returned + dropped + left
    # episodes resumed after the update mix policy versions, each token tagged
    mixed = [e for e in second.episodes if set(e.versions) == {0, 1}]
    assert mixed, "a carried-over episode should hold tokens of both versions"


@pytest.mark.parametrize("unchanged", [False, True], ids=["new weights", "relabelled weights"])
def test_staleness_bound_drops_carried_groups(tokenizer, unchanged):
    """At ``max_staleness=0`` the groups carried over from the last version are dropped after a
    weight update. A trainer step that updated nothing relabels the same weights as the next
    version (``weights_unchanged``): then they are kept, and the mark survives a checkpoint of the
    rollout."""

    async def main():
        model = tiny_model()
        eng = EmbeddedEngine(model, max_batch_size=8)
        cfg = RolloutConfig(
            responses_per_prompt=2,
            max_new_tokens=32,
            partial_rollout=True,
            partial_oversample=1.0,
            max_staleness=0,
            concurrency=3,
        )
        ro = Rollout(eng, tokenizer, ENV, cfg)
        for _ in range(5):  # the oversampled group may finish in the same round as the returned one
            await ro.collect(1)
            if ro._inflight:
                break
        carried = len(ro._inflight)
        if unchanged:
            await eng.update_weights(model.state_dict(), version=1)
            ro.weights_unchanged(1)
        else:
            await eng.update_weights(tiny_model(seed=2).state_dict())
        second = await ro.collect(1)
        state = ro.state_dict()
        await ro.close()
        await eng.close()
        return carried, second, state

    carried, second, state = asyncio.run(main())
    assert carried > 0
    if not unchanged:
        assert second.metrics["rollout/dropped_stale"] >= 1
        assert all(set(e.versions) == {1} for e in second.episodes)
        return
    assert second.metrics["rollout/dropped_stale"] == 0
    restored = Rollout(None, tokenizer, ENV, RolloutConfig())
    restored.load_state_dict({**state, "ready": [], "in_flight": []})
    assert state["unchanged_versions"] == [1] and restored.staleness(0, 1) == 0


def test_staleness_counts_only_weight_changes_by_hand(tokenizer):
    ro = Rollout(None, tokenizer, ENV, RolloutConfig())
    assert [ro.staleness(0, v) for v in range(4)] == [0, 1, 2, 3]
    ro.weights_unchanged(2)
    assert [ro.staleness(0, v) for v in range(4)] == [0, 1, 1, 2]
    assert ro.staleness(1, 2) == 0 and ro.staleness(2, 3) == 1 and ro.staleness(3, 3) == 0


def _tokens(episodes):
    return [tuple(e.sequences[0].input_ids) for e in episodes]


def test_seeded_rollouts_do_not_depend_on_batching(tokenizer):
    """Per-request sampling seeds: the same groups whatever the concurrency and engine seed."""

    async def main(concurrency, engine_seed):
        eng = EmbeddedEngine(tiny_model(), seed=engine_seed, max_batch_size=concurrency)
        cfg = RolloutConfig(responses_per_prompt=2, max_new_tokens=6, temperature=30.0, concurrency=concurrency, seed=5)
        ro = Rollout(eng, tokenizer, "rl2/Countdown-v0", cfg)
        batch = await ro.collect(3)
        await ro.close()
        await eng.close()
        return batch

    a, b = asyncio.run(main(1, 0)), asyncio.run(main(6, 1))
    assert {g[0].group: _tokens(g) for g in a.groups} == {g[0].group: _tokens(g) for g in b.groups}
    assert len(set(_tokens(a.episodes))) == 6  # the samples of a group differ


class FirstGroupLastEnv(SlowSearchEnv):
    """Group 0's episodes (reset seed 0 with ``seed=0``) start half a second late, so that group
    finishes last."""

    async def _areset(self, options):
        if self._episode_seed == 0:
            await asyncio.sleep(0.5)
        return await super()._areset(options)


def test_groups_come_back_in_the_order_they_were_started(tokenizer):
    """Not in completion order: the trainer then splits the same sequences over its micro-batches
    and ranks in every run, so per-token metrics (the KL its controller reads) do not depend on
    thread timing."""

    async def main():
        eng = EmbeddedEngine(tiny_model(), max_batch_size=8)
        cfg = RolloutConfig(responses_per_prompt=2, max_new_tokens=4, concurrency=3, seed=0)
        ro = Rollout(eng, tokenizer, lambda: FirstGroupLastEnv(latency=0.0, max_turns=2), cfg)
        batch = await ro.collect(3)
        await ro.close()
        await eng.close()
        return batch

    batch = asyncio.run(main())
    assert [group[0].group for group in batch.groups] == [0, 1, 2]


def test_state_dict_restores_position_and_partial_buffer(tokenizer):
    """A checkpointed rollout: completed surplus groups come back with their tokens, groups in
    flight restart with the same env seed, new groups continue the id sequence."""
    import pickle

    cfg = RolloutConfig(
        responses_per_prompt=2, max_new_tokens=24, partial_rollout=True, partial_oversample=1.0, concurrency=3, seed=3
    )

    async def first():
        eng = EmbeddedEngine(tiny_model(), max_batch_size=8)
        ro = Rollout(eng, tokenizer, ENV, cfg)
        await ro.collect(2)
        state = pickle.dumps(ro.state_dict())
        prompts = {
            g.gid: g.episodes[0].sequences[0].input_ids[:20]
            for g in ro._inflight.values()
            if g.episodes and g.episodes[0].sequences
        }
        ready = {g.gid: _tokens(g.episodes) for g in ro._ready}
        await ro.close()
        await eng.close()
        return state, prompts, ready

    state, prompts, ready = asyncio.run(first())
    st = pickle.loads(state)
    assert st["in_flight"] and st["next_gid"] > max(st["in_flight"])

    async def second():
        eng = EmbeddedEngine(tiny_model(), max_batch_size=8)
        ro = Rollout(eng, tokenizer, ENV, cfg)
        ro.load_state_dict(pickle.loads(state))
        want = len(st["ready"]) + len(st["in_flight"]) + 1
        got = {}
        for _ in range(4):  # a fresh group can complete before a restarted one: it then comes in a later batch
            batch = await ro.collect(want)
            got |= {g[0].group: g for g in batch.groups}
            if set(st["in_flight"]) <= set(got):
                break
        await ro.close()
        await eng.close()
        return got

    got = asyncio.run(second())
    assert set(st["in_flight"]) | {gid for gid, _ in st["ready"]} < set(got)
    assert max(got) >= st["next_gid"]  # fresh groups continue the sequence
    for gid, toks in ready.items():
        assert _tokens(got[gid]) == toks
    for gid, prefix in prompts.items():
        assert got[gid][0].sequences[0].input_ids[:20] == prefix


def test_bad_config():
    with pytest.raises(ValueError):
        Rollout(None, None, ENV, RolloutConfig(responses_per_prompt=0))


def test_merge_rank_metrics_sums_counts_and_averages_rates():
    ranks = [
        {"rollout/episodes": 8.0, "rollout/reward": 0.25, "time/rollout": 2.0},
        {"rollout/episodes": 4.0, "rollout/reward": 0.75, "time/rollout": 4.0},
    ]
    merged = merge_rank_metrics(ranks)  # per-episode means over all 12 episodes; wall times averaged
    assert merged == {"rollout/episodes": 12.0, "rollout/reward": pytest.approx(5 / 12), "time/rollout": 3.0}
    # a rank whose groups were all dropped (no episodes, no component means) does not count
    empty = {"rollout/episodes": 0.0, "rollout/reward": 0.0, "time/rollout": 6.0}
    ranks[0]["rollout/component/correctness"] = 1.0
    merged = merge_rank_metrics([ranks[0], empty])
    assert merged["rollout/reward"] == 0.25 and merged["rollout/component/correctness"] == 1.0
    assert merged["rollout/episodes"] == 8.0 and merged["time/rollout"] == 4.0
    assert merge_rank_metrics([empty, empty])["rollout/reward"] == 0.0
    # a rank that kept nothing reports no episode means but its episodes before filtering count
    kept_none = {"rollout/episodes": 0.0, "rollout/unfiltered_episodes": 6.0, "rollout/unfiltered_reward": 0.0}
    kept_some = {"rollout/episodes": 2.0, "rollout/reward": 0.5, "rollout/unfiltered_episodes": 2.0}
    kept_some["rollout/unfiltered_reward"] = 0.5
    kept_none["rollout/filtered_ratio"], kept_some["rollout/filtered_ratio"] = 1.0, 0.0
    merged = merge_rank_metrics([kept_none, kept_some])
    assert merged["rollout/reward"] == 0.5 and merged["rollout/unfiltered_reward"] == pytest.approx(1 / 8)
    assert merged["rollout/filtered_ratio"] == pytest.approx(6 / 8)  # by episodes before filtering
    assert merged["rollout/unfiltered_episodes"] == 8.0
    with pytest.raises(ValueError, match="at least one rank"):
        merge_rank_metrics([])
