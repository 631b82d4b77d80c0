"""Multi-objective rewards: combiners by hand, the combined reward placed where the env's was,
hypervolume against hand values and Monte Carlo, the Pareto archive, and the envs' components."""

import random

import pytest

import rl2gem
from rl2gem.evaluation import episode_record, record_sums
from rl2gem.rewards.objectives import (
    FILTERED_REWARD,
    Overlong,
    ParetoArchive,
    apply_objectives,
    dominates,
    episode_components,
    hypervolume,
    load_transform,
    set_final_reward,
    tchebycheff,
    weighted_sum,
)
from rl2gem.rollout.rollout import RolloutBatch
from rl2gem.rollout.tito import Episode, Sequence
from rl2gem.training.samples import episode_samples, gathered_samples, shape_rewards, without_cut_off


def episode(correct: float, fmt: float, action_tokens: int) -> Episode:
    """A one-turn episode: 3 prompt tokens, then ``action_tokens`` action tokens, reward = correctness."""
    n = 3 + action_tokens
    mask = [0, 0, 0] + [1] * action_tokens
    rewards = [0.0] * n
    rewards[-1] = correct
    seq = Sequence(list(range(n)), mask, [0.0] * n, [0] * n, rewards)
    return Episode(
        sequences=[seq],
        turns=1,
        turn_rewards=[correct],
        info={"reward_components": {"correctness": correct, "format": fmt}},
    )


def test_combiners_by_hand():
    c = {"correctness": 1.0, "format": 0.0, "length": 20.0}
    assert weighted_sum(c, {"correctness": 1.0, "format": 0.5, "length": -0.01}) == pytest.approx(0.8)
    # distances to the ideal point (1, 1, 0) weighted: |0|*1, |1|*0.5, |20|*0.01 -> worst is 0.5
    assert (
        tchebycheff(
            c, {"correctness": 1.0, "format": 0.5, "length": -0.01}, {"correctness": 1, "format": 1, "length": 0}
        )
        == -0.5
    )
    with pytest.raises(KeyError, match="searches"):
        weighted_sum(c, {"searches": 1.0})
    with pytest.raises(ValueError, match="module:function"):
        load_transform("no_colon")
    assert load_transform("math:sqrt")(4.0) == 2.0


def test_apply_replaces_the_reward_where_the_env_put_it():
    batch = RolloutBatch([[episode(1.0, 1.0, 4), episode(0.0, 1.0, 10)], [episode(0.0, 0.0, 2)]], {})
    metrics = apply_objectives(batch, "weighted_sum", {"correctness": 1.0, "format": 0.5, "length": -0.1})
    expected = [1.0 + 0.5 - 0.4, 0.0 + 0.5 - 1.0, 0.0 + 0.0 - 0.2]
    for e, value in zip(batch.episodes, expected, strict=True):
        assert e.reward == pytest.approx(value) and e.turn_rewards == [pytest.approx(value)]
        assert e.sequences[0].rewards[-1] == pytest.approx(value) and sum(e.sequences[0].rewards) == pytest.approx(
            value
        )
        assert e.info["reward_components"]["length"] == e.num_action_tokens
    assert metrics["rollout/component/correctness"] == pytest.approx(1 / 3)
    assert metrics["rollout/component/length"] == pytest.approx(16 / 3)
    # without a combiner only the means are reported; the rewards stay
    batch = RolloutBatch([[episode(1.0, 1.0, 4)]], {})
    assert apply_objectives(batch, None)["rollout/component/format"] == 1.0 and batch.episodes[0].reward == 1.0
    # a transform sees the combined value and the components
    batch = RolloutBatch([[episode(1.0, 1.0, 4)]], {})
    apply_objectives(batch, None, transform=lambda r, comps, ep: r - 0.25 * comps["length"])
    assert batch.episodes[0].reward == 0.0
    assert episode_components(episode(0.0, 1.0, 7)) == {
        "correctness": 0.0,
        "format": 1.0,
        "reward": 0.0,
        "length": 7.0,
        "turns": 1.0,
        "invalid_actions": 0.0,
    }
    # an invalid-move penalty: the env's count of the episode (its last info) is a component
    game = episode(1.0, 1.0, 4)
    game.info["num_invalid_actions"] = 3
    batch = RolloutBatch([[game, episode(1.0, 1.0, 4)]], {})
    metrics = apply_objectives(batch, "weighted_sum", {"reward": 1.0, "invalid_actions": -0.2})
    assert [e.reward for e in batch.episodes] == [pytest.approx(0.4), pytest.approx(1.0)]
    assert metrics["rollout/component/invalid_actions"] == pytest.approx(1.5)


def test_an_episode_that_ended_unscored_counts_its_missing_components_as_zero():
    """A rejected answer (an empty action: the env reports no component) or a truncation gets 0.0
    for the components it lacks, in the combined reward and in the batch's means; it stopped the
    training step with a KeyError. A scored ending that lacks a weighted component still raises."""
    env = rl2gem.make("rl2/GSM8K-v0")
    env.reset(seed=0)
    _, _, terminated, _, info = env.step("   \n")
    env.close()
    # GSM8K reports its components as 0 on a refused action (Env.unscored_info); an env need not
    assert terminated and info["invalid_action"] and info["reward_components"] == {"correctness": 0.0, "format": 0.0}
    rejected = episode(0.0, 0.0, 3)
    rejected.info = {"invalid_action": info["invalid_action"]}  # an env that reports no component
    truncated = episode(0.0, 0.0, 5)
    truncated.info, truncated.truncated = {"reward_components": {"tool_calls": 2.0}}, True
    batch = RolloutBatch([[episode(1.0, 1.0, 4), rejected, truncated]], {})
    metrics = apply_objectives(batch, "weighted_sum", {"correctness": 1.0, "format": 0.5})
    assert [e.reward for e in batch.episodes] == [pytest.approx(1.5), 0.0, 0.0]
    assert metrics["rollout/component/correctness"] == pytest.approx(1 / 3)
    assert metrics["rollout/component/tool_calls"] == pytest.approx(2 / 3)
    scored = episode(1.0, 1.0, 4)
    scored.info = {"reward_components": {"format": 1.0}}
    with pytest.raises(KeyError, match="correctness"):
        apply_objectives(RolloutBatch([[scored]], {}), "weighted_sum", {"correctness": 1.0})


def test_hypervolume_by_hand_and_against_monte_carlo():
    assert hypervolume([(1, 3), (2, 2), (3, 1)], (0, 0)) == 6  # a staircase of three unit columns
    assert hypervolume([(1, 3), (2, 2), (3, 1), (1, 1)], (0, 0)) == 6  # a dominated point adds nothing
    assert hypervolume([(1, 2, 3)], (0, 0, 0)) == 6 and hypervolume([(-1, 5)], (0, 0)) == 0
    rng = random.Random(0)
    points = [tuple(rng.uniform(0.1, 1.0) for _ in range(3)) for _ in range(6)]
    hits = 0
    samples = 200_000
    for _ in range(samples):
        x = (rng.random(), rng.random(), rng.random())
        hits += any(all(p[i] >= x[i] for i in range(3)) for p in points)
    assert hypervolume(points, (0, 0, 0)) == pytest.approx(hits / samples, abs=0.005)


def test_pareto_archive_keeps_the_non_dominated_points():
    archive = ParetoArchive(["correctness", "length"], minimize=["length"], reference={"length": 100})
    assert archive.add({"correctness": 0.5, "length": 40}, step=0)
    assert not archive.add({"correctness": 0.4, "length": 50}, step=1)  # worse in both
    assert archive.add({"correctness": 0.6, "length": 60}, step=2)  # better and longer: a trade-off
    assert archive.add({"correctness": 0.7, "length": 30}, step=3)  # dominates both
    assert [p["step"] for p in archive.points] == [3]
    assert archive.add({"correctness": 0.8, "length": 90}, step=4)
    # (0.7, 100-30=70) and (0.8, 10) against (0, 0): 0.7 * 70 + 0.1 * 10
    assert archive.metrics() == {"pareto/size": 2.0, "pareto/hypervolume": pytest.approx(0.7 * 70 + 0.1 * 10)}
    restored = ParetoArchive(["correctness", "length"], minimize=["length"], reference={"length": 100})
    restored.load_state_dict(archive.state_dict())
    assert restored.points == archive.points
    assert dominates((1, 1), (1, 0)) and not dominates((1, 0), (0, 1)) and not dominates((1, 1), (1, 1))
    with pytest.raises(ValueError, match="hypervolume reference"):
        ParetoArchive(["length"], minimize=["length"])


def test_envs_report_components_and_evaluation_sums_them():
    env = rl2gem.make("rl2/ReasoningGym-v0", task="basic_arithmetic", answer="last_number")
    env.reset(seed=0)
    answer = env.unwrapped.item["answer"]
    _, reward, _, _, info = env.step(f"It is {answer}")
    assert reward == 1.0 and info["reward_components"] == {"correctness": 1.0, "format": 1.0}
    env.reset(seed=1)
    _, _, _, _, info = env.step("no idea")
    assert info["reward_components"] == {"correctness": 0.0, "format": 0.0}
    math_env = rl2gem.make("rl2/GSM8K-v0")
    math_env.reset(seed=0)
    _, _, _, _, info = math_env.step("The answer is \\boxed{-1}")
    assert info["reward_components"]["format"] == 1.0
    records = [episode_record(i, e, 0) for i, e in enumerate([episode(1.0, 1.0, 4), episode(0.0, 1.0, 5)])]
    sums = record_sums(records)
    assert sums["component/correctness"] == 1.0 and sums["component/format"] == 2.0


def test_the_trainers_filter_sees_the_rewards_apply_objectives_sets():
    """Dynamic filtering compares ``OnlineTrainer.trained_rewards`` of a group as it finishes: the
    rewards :func:`apply_objectives` then sets, the episodes untouched until then. An all-loss
    group of GuessTheNumber whose invalid-move counts differ has a signal there (it was dropped on
    the env's equal rewards)."""
    import types

    from omegaconf import OmegaConf

    from rl2gem.training.online import OnlineTrainer

    weights = {"reward": 1.0, "invalid_actions": -0.2}
    config = {"reward": {"objectives": {"combine": "weighted_sum", "weights": weights, "reference": {}}}}
    trainer = types.SimpleNamespace(cfg=OmegaConf.create(config), transform=None, overlong=None)
    lost, careless = episode(0.0, 1.0, 4), episode(0.0, 1.0, 4)
    careless.info["num_invalid_actions"] = 2
    group = [lost, careless]
    trained = OnlineTrainer.trained_rewards(trainer, group)
    assert [e.reward for e in group] == [0.0, 0.0] and trained == [0.0, pytest.approx(-0.4)]
    apply_objectives(RolloutBatch([group], {}), "weighted_sum", weights)
    assert [e.reward for e in group] == trained

    # a transform with state runs once per episode: the training gets the values the filter saw
    calls = []

    def counting(value, components, episode):
        calls.append(value)
        return value + len(calls)

    trainer.transform = counting
    group = [episode(0.0, 1.0, 4), episode(1.0, 1.0, 4)]
    filtered = OnlineTrainer.trained_rewards(trainer, group)
    assert filtered == [1.0, 3.0] and OnlineTrainer.trained_rewards(trainer, group) == filtered
    apply_objectives(RolloutBatch([group], {}), "weighted_sum", weights, transform=counting)
    assert [e.reward for e in group] == filtered and len(calls) == 2

    # a reward model's score comes after the filter: the kept values are dropped, not trained on
    class Scorer:
        def apply(self, batch, mode):
            for e in batch.episodes:
                set_final_reward(e, 5.0)
            return {}

    group = [episode(0.0, 1.0, 4), episode(1.0, 1.0, 4)]
    OnlineTrainer.trained_rewards(trainer, group)
    shape_rewards(RolloutBatch([group], {}), Scorer(), "replace", "weighted_sum", weights, {}, None)
    assert [e.reward for e in group] == [5.0, 5.0] and all(FILTERED_REWARD not in e.info for e in group)


def played(correct: float, lengths: list[int], cut_off: bool) -> Episode:
    """A one-turn :func:`episode` whose actions generated ``lengths`` tokens, the last one cut off
    at its limit or not."""
    e = episode(correct, 1.0, 4)
    e.action_lengths = list(lengths)
    e.finish_reasons = ["stop"] * (len(lengths) - 1) + ["length" if cut_off else "stop"]
    return e


def test_dapo_s_soft_overlong_punishment_by_hand():
    """DAPO's eq. 13 with L_max 10 and L_cache 4: 0 up to 6 tokens, then -(n - 6) / 4, -1 at 10; an
    episode gets its longest action's; added where the env's final reward is."""
    overlong = Overlong(max_new_tokens=10, buffer=4, penalty=1.0)
    penalties = [overlong.penalty_of(played(0.0, [n], n == 10)) for n in (3, 6, 7, 8, 10)]
    assert penalties == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong.penalty_of(played(0.0, [3, 9, 5], False)) == -0.75
    assert Overlong(10, buffer=4, penalty=0.5).penalty_of(played(0.0, [8], False)) == -0.25
    assert Overlong(10).penalty_of(played(0.0, [10], True)) == 0.0 and not Overlong(10).active
    batch = RolloutBatch([[played(1.0, [8], False), played(1.0, [10], True)], [played(0.0, [2], False)]], {})
    metrics = shape_rewards(batch, overlong=overlong)
    assert [e.reward for e in batch.episodes] == [0.5, 0.0, 0.0]
    assert [e.sequences[0].rewards[-1] for e in batch.episodes] == [0.5, 0.0, 0.0]
    assert metrics["rollout/overlong_penalty"] == pytest.approx(-0.5)
    assert metrics["rollout/cut_off"] == pytest.approx(1 / 3) and metrics["rollout/reward"] == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="buffer"):
        Overlong(10, buffer=11)
    with pytest.raises(ValueError, match="penalty"):
        Overlong(10, buffer=2, penalty=-1.0)


def test_overlong_filtering_leaves_cut_off_episodes_out_of_the_loss_not_the_baseline():
    """DAPO's overlong filtering: the cut-off episode leaves the step after RLOO's advantages, which
    still count its reward: the two others' baselines are means over the two others of three."""
    group = [played(1.0, [3], False), played(0.0, [3], False), played(1.0, [10], True)]
    samples = gathered_samples([episode_samples(RolloutBatch([group], {}), "rloo")], "rloo")
    kept, share = without_cut_off(samples)
    assert share == pytest.approx(1 / 3) and kept == samples[:2]
    # RLOO: each against the mean of the two others, the cut-off one among them
    assert [s.advantages[-1] for s in samples[:2]] == [pytest.approx(1.0 - 0.5), pytest.approx(0.0 - 1.0)]


def test_the_trainers_filter_compares_rewards_before_the_overlong_punishment():
    """DAPO keeps a group on its accuracy: a group of equal rewards whose lengths differ is
    dropped (the filter compared punished rewards and kept it, so that all-wrong groups trained
    toward shorter wrong answers), and training then gets the rewards punished once."""
    import types

    from omegaconf import OmegaConf

    from rl2gem.training.online import OnlineTrainer

    config = {"reward": {"objectives": {"combine": None, "weights": {}, "reference": {}}}}
    overlong = Overlong(max_new_tokens=10, buffer=4)
    trainer = types.SimpleNamespace(cfg=OmegaConf.create(config), transform=None, overlong=overlong)
    group = [played(1.0, [4], False), played(1.0, [9], False)]
    assert OnlineTrainer.trained_rewards(trainer, group) == [1.0, 1.0]
    shape_rewards(RolloutBatch([group], {}), overlong=overlong)
    assert [e.reward for e in group] == [1.0, 0.25]
