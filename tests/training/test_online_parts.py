"""The pieces of the online trainer base: the old log-probs' source step by step, rewards shaped
into the ones trained on (and their statistics recomputed), the PPO config's checks."""

import inspect
import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rl2gem.trainers.ppo import CONFIG, computed_token_fraction

from rl2gem.algorithms import turn_rloo
from rl2gem.config import ConfigError, load_config
from rl2gem.parallel.packing import MicroBatch
from rl2gem.rollout import EmbeddedEngine
from rl2gem.rollout.rollout import RolloutBatch, reward_metrics
from rl2gem.rollout.tito import Episode, Sequence
from rl2gem.training.old_logprobs import OldLogprobs
from rl2gem.training.online import engine_metrics
from rl2gem.training.rl_config import ENGINE_KEYS, check_config, engine_options
from rl2gem.training.samples import (
    Sample,
    episode_samples,
    gathered_samples,
    packed_field,
    samples_from_batch,
    shape_rewards,
)
from tests.rewards.test_objectives import episode


def sample(versions, mask):
    return SimpleNamespace(versions=versions, mask=mask)


def test_the_old_logprobs_come_from_the_engine_only_when_exactly_on_policy_and_checked():
    on_policy = [sample([0, 0, 3, 3], [0, 0, 1, 1])]  # prompt tokens carry any version
    stale = [sample([0, 0, 2, 3], [0, 0, 1, 1])]  # one action token of version 2 (partial rollout)
    auto = OldLogprobs("auto", max_kl=1e-3)
    assert auto.source(on_policy, step=3) == "check" and auto.source(stale, step=3) == "recompute"
    # bf16-like noise: one token 0.03 nats off, the rest 0.005: the largest difference is far past
    # 1e-3, the mismatch KL (mean k3 = exp(-d) - 1 + d, about d^2 / 2) is not
    trainer = torch.zeros(1000)
    engine = torch.full((1000,), 0.005)
    engine[7] = -0.03
    mask = torch.ones(1000)
    mask[500:] = 0  # prompt tokens are not compared
    first = OldLogprobs.compare(trainer[:300], engine[:300], mask[:300])
    rest = OldLogprobs.compare(trainer[300:], engine[300:], mask[300:])
    measured = OldLogprobs.combine(first, rest)
    expected_kl = (499 * (math.exp(-0.005) - 1 + 0.005) + (math.exp(0.03) - 1 - 0.03)) / 500
    assert measured.tolist() == pytest.approx([expected_kl * 500, 500.0, 0.03], rel=1e-4)
    assert auto.decide(measured) == {
        "actor/old_logprob_mismatch_kl": pytest.approx(expected_kl, rel=1e-4),
        "actor/old_logprob_max_diff": pytest.approx(0.03, rel=1e-4),
    }
    assert auto.match is True and auto.source(on_policy, step=3) == "rollout"
    assert auto.source(stale, step=3) == "recompute"  # never the engine's for older tokens
    strict = OldLogprobs("auto", max_kl=1e-3)
    strict.decide(OldLogprobs.compare(trainer[:10], trainer[:10] + 0.1, mask[:10]))  # KL about 5e-3
    assert strict.match is False and strict.source(on_policy, step=3) == "recompute"
    assert OldLogprobs("rollout", 0.0).source(on_policy, step=3) == "rollout"
    assert OldLogprobs("recompute", 1.0).source(on_policy, step=3) == "recompute"
    resumed = OldLogprobs("auto", max_kl=1e-3)  # a checkpoint keeps the check's outcome
    resumed.load_state_dict(auto.state_dict())
    assert resumed.source(on_policy, step=3) == "rollout"
    resumed.load_state_dict(strict.state_dict())
    assert resumed.source(on_policy, step=3) == "recompute"
    two_passes = OldLogprobs("rollout", 1.0, update_per_rollout=2)
    two_minibatches = OldLogprobs("auto", 1.0, minibatches_per_update=2)
    assert two_passes.source(on_policy, 3) == two_minibatches.source(on_policy, 3) == "recompute"
    # from the update's own forward: auto, not the engine's, on-policy, nothing reading them first
    fresh = OldLogprobs("auto", max_kl=1e-3)
    assert fresh.plan(on_policy, 3, read_before_update=False) == ("check", True)
    assert fresh.plan(on_policy, 3, read_before_update=True) == ("check", False)  # a critic
    assert strict.plan(on_policy, 3, read_before_update=False) == ("recompute", True)
    assert auto.plan(on_policy, 3, read_before_update=False) == ("rollout", False)
    assert strict.plan(stale, 3, read_before_update=False) == ("recompute", False)
    assert two_minibatches.plan(on_policy, 3, read_before_update=False) == ("recompute", False)
    assert OldLogprobs("recompute", 1.0).plan(on_policy, 3, read_before_update=False) == ("recompute", False)


def test_success_is_the_env_s_verdict_not_a_positive_reward():
    """``rollout/success`` counts the episodes whose env said ``success`` (a shaped reward above 0
    for a wrong answer is no success; it counted as one); an env that says nothing falls back to
    a reward above 0."""
    groups = [[episode(1.0, 1.0, 4), episode(0.0, 1.0, 10)], [episode(0.0, 0.0, 2), episode(0.0, 1.0, 6)]]
    for played, won in zip([e for g in groups for e in g], [True, False, False, False], strict=True):
        played.info["success"] = won
    batch = RolloutBatch(groups, {})
    metrics = shape_rewards(batch, transform=lambda reward, components, ep: reward + 0.1 * components["length"])
    assert all(e.reward > 0 for e in batch.episodes) and metrics["rollout/success"] == 0.25


def test_shaped_rewards_are_the_ones_logged_and_the_env_mean_is_kept():
    groups = [[episode(1.0, 1.0, 4), episode(0.0, 1.0, 10)], [episode(0.0, 0.0, 2), episode(0.0, 1.0, 6)]]
    batch = RolloutBatch(groups, {})
    batch.metrics.update(reward_metrics(batch.groups))
    assert batch.metrics["rollout/reward"] == 0.25 and batch.metrics["rollout/zero_variance_groups"] == 0.5
    untouched = shape_rewards(batch)  # nothing configured: component means only, rewards as they were
    assert "rollout/env_reward" not in untouched and [e.reward for e in batch.episodes] == [1.0, 0.0, 0.0, 0.0]
    metrics = shape_rewards(batch, transform=lambda reward, components, ep: reward + 0.1 * components["length"])
    shaped = [1.4, 1.0, 0.2, 0.6]  # + 0.1 per action token
    assert [e.reward for e in batch.episodes] == pytest.approx(shaped)
    assert metrics["rollout/env_reward"] == 0.25
    assert metrics["rollout/reward"] == pytest.approx(sum(shaped) / 4) and metrics["rollout/success"] == 1.0
    assert metrics["rollout/zero_variance_groups"] == 0.0
    assert metrics["rollout/group_reward_std"] == pytest.approx((0.2 + 0.2) / 2)
    assert statistics.pstdev(shaped[:2]) == pytest.approx(0.2)


def test_packed_field_and_the_computed_token_fraction():
    samples = [Sample([1, 2, 3, 4], [0, 0, 1, 1]), Sample([1, 2, 3, 5], [0, 1, 1, 1]), Sample([7, 8], [0, 1])]
    row = packed_field(samples[:2], "mask", torch.device("cpu"), torch.bool)
    assert row.tolist() == [False, False, True, True, False, True, True, True] and row.dtype == torch.bool
    plan = [MicroBatch([0, 1]), MicroBatch([2]), MicroBatch([2], placeholder=True)]
    assert computed_token_fraction(samples, plan, None) == 1.0
    # the tree computes 1 2 3 once: 3 + 1 + 1 + 2 tokens against 4 + 4 + 2 (the placeholder not counted)
    assert computed_token_fraction(samples, plan, [s.ids for s in samples]) == pytest.approx(7 / 10)
    assert computed_token_fraction(samples, [MicroBatch([2], placeholder=True)], None) == 0.0


def test_the_ppo_config_checks_name_the_key():
    base = OmegaConf.load(CONFIG)
    for override, key in [
        ("adv.estimator=nope", "adv.estimator"),
        ("reward.mode=multiply", "reward.mode"),
        ("actor.old_logprobs=engine", "actor.old_logprobs"),
        ("reward.objectives.combine=tchebycheff", "reward.objectives.combine"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_config(OmegaConf.merge(base, OmegaConf.from_dotlist([override])))
    check_config(base)  # the defaults pass


def _sequence(turns: list[tuple[int, float]], context: int = 1) -> Sequence:
    """A sequence: ``context`` prompt tokens, then each turn's action tokens (its reward on the
    last) followed by one env token."""
    s = Sequence()
    s.extend_context([1] * context)
    for length, reward in turns:
        s.extend_action([2] * length, [0.0] * length, 0)
        s.rewards[-1] = reward
        s.extend_context([3])
    return s


def test_turn_rloo_samples_number_the_turns_across_an_episodes_sequences():
    """An episode split in two sequences (a non-append-only template, a context segment) keeps
    its later turns' rewards in its first sequence's returns-to-go: the same advantages as the
    episode in one sequence."""
    whole = Episode(sequences=[_sequence([(2, 0.2), (3, 0.0), (1, 0.5)])], group=0)
    split = Episode(sequences=[_sequence([(2, 0.2)]), _sequence([(3, 0.0), (1, 0.5)], context=4)], group=0)
    other = Episode(sequences=[_sequence([(2, 0.2), (2, 1.0)])], group=0)
    per_turn = turn_rloo(
        torch.tensor([[0.2, 0.0, 0.5], [0.2, 1.0, 0.0]]),
        torch.tensor([[1, 1, 1], [1, 1, 0]]).bool(),
        torch.tensor([0, 0]),
    )
    want = per_turn[0].tolist()  # [0.7 - 1.2, 0.5 - 1.0, 0.5 - 0.0]
    assert want == pytest.approx([-0.5, -0.5, 0.5])
    for played in (whole, split):
        samples = samples_from_batch(RolloutBatch([[played, other]], {}), "turn_rloo")
        assert len(samples) == len(played.sequences) + 1
        advantages = [a for s in samples[:-1] for a, m in zip(s.advantages, s.mask, strict=True) if m]
        assert advantages == pytest.approx([want[0]] * 2 + [want[1]] * 3 + [want[2]])
        assert samples[-1].advantages[1:3] == pytest.approx([0.5] * 2)  # 1.2 - 0.7
        assert all(a == 0 for s in samples for a, m in zip(s.advantages, s.mask, strict=True) if not m)


def _played(turns, split_after=None):
    """An episode of ``turns`` ((length, reward) each), in one sequence or split in two after turn
    ``split_after`` (the second with a context of its own), with its turn rewards."""
    if split_after is None:
        sequences = [_sequence(turns)]
    else:
        sequences = [_sequence(turns[:split_after]), _sequence(turns[split_after:], context=4)]
    return Episode(sequences=sequences, group=0, turn_rewards=[reward for _, reward in turns])


def _action_advantages(samples):
    return [a for s in samples for a, m in zip(s.advantages, s.mask, strict=True) if m]


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_pp", "rebn", "turn_rloo"])
def test_an_episode_split_in_two_sequences_gets_the_advantages_of_one(estimator):
    """A context split or segment carries an episode's later turns in a second sequence: the
    episode still counts once in its group's statistics (an outcome estimator gave each sequence
    the episode's return: counted twice, and RLOO's baseline held the episode's own other half),
    and returns-to-go run across the sequences (they stopped at the first's end: its early turns
    saw none of the reward that came later)."""
    turns = [(2, 0.0), (3, 0.0), (1, 1.0)]
    others = [_played([(2, 0.0), (2, 0.0)]), _played([(1, 0.5), (2, 0.0)])]
    whole = samples_from_batch(RolloutBatch([[_played(turns), *others]], {}), estimator)
    split = samples_from_batch(RolloutBatch([[_played(turns, split_after=1), *others]], {}), estimator)
    assert len(split) == len(whole) + 1
    assert _action_advantages(split) == pytest.approx(_action_advantages(whole), abs=1e-6)
    first = [a for a, m in zip(split[0].advantages, split[0].mask, strict=True) if m]
    assert all(a > 0 for a in first)  # the turns that led to the reward are credited with it


@pytest.mark.parametrize("estimator", ["reinforce_pp", "rebn", "grpo"])
def test_advantages_over_the_gathered_ranks_are_the_whole_step_s(estimator):
    """Two ranks' samples, gathered and numbered per rank, get the advantages one rank with the
    whole step would give: ``reinforce_pp``'s and ``rebn``'s normalisation is over the step (it was
    over each rank's own tokens, so the world size changed the advantages)."""
    groups = [
        [_played([(2, 0.0), (1, 1.0)]), _played([(3, 0.0)])],
        [_played([(1, 0.2)]), _played([(2, 0.0), (2, 0.3)])],
    ]
    one_rank = samples_from_batch(RolloutBatch(groups, {}), estimator)
    two_ranks = gathered_samples([episode_samples(RolloutBatch([group], {}), estimator) for group in groups], estimator)
    assert _action_advantages(two_ranks) == pytest.approx(_action_advantages(one_rank), abs=1e-6)
    alone = samples_from_batch(RolloutBatch(groups[1:], {}), estimator)  # one rank's own statistics
    if estimator != "grpo":  # a group's statistics are its own: only the batch's differ
        assert _action_advantages(alone) != pytest.approx(_action_advantages(two_ranks[-len(alone) :]), abs=1e-3)


def test_engine_metrics_are_the_counts_between_two_snapshots():
    before = {"decode_steps": 10, "decode_rounds": 10, "time_decode_ms": 500, "requests": 3}
    after = {"decode_steps": 50, "decode_rounds": 20, "time_decode_ms": 2500, "prefill_forwards": 4, "requests": 9}
    metrics = engine_metrics(before, after)
    assert metrics["engine/decode_steps"] == 40.0 and metrics["engine/decode_rounds"] == 10.0
    assert metrics["engine/time_decode_s"] == 2.0 and metrics["engine/prefill_forwards"] == 4.0
    assert metrics["engine/decode_graph_captures"] == 0.0 and "engine/requests" not in metrics
    assert metrics["engine/time_decode_forward_s"] == metrics["engine/time_decode_handout_s"] == 0.0
    assert engine_metrics({}, {}) == {}  # an engine without counters (HTTP)


def test_rollout_engine_keys_are_the_engine_s_arguments_and_auto_is_its_default():
    """Every key of ppo.yaml's ``rollout.engine`` is an :class:`EmbeddedEngine` argument of that
    name, and the section as written builds the engine the trainers built before it existed."""
    cfg = load_config(CONFIG, [])
    assert tuple(cfg.rollout.engine) == ENGINE_KEYS
    parameters = inspect.signature(EmbeddedEngine).parameters
    for key, value in engine_options(cfg).items():
        assert parameters[key].default == value, key  # auto and the written values are the defaults
    assert engine_options(load_config(CONFIG, ["rollout.engine.decode_steps=2"]))["decode_steps"] == 2
    assert engine_options(load_config(CONFIG, ["rollout.engine=null"])) == {}  # the engine's defaults
