"""rl2gem.evaluation's statistics on evaluation records."""

import asyncio
import itertools
import os
import random
from types import SimpleNamespace

import pytest

from rl2gem.evaluation import (
    EpisodeRecord,
    default_output,
    episode_max_length,
    evaluate,
    paired_comparison,
    pass_at_k,
    summarize,
)


def test_paired_comparison_counts_discordant_items_and_gives_the_exact_sign_test():
    def evaluation(solved, em=True):
        return [
            EpisodeRecord(i, 7, i, float(s), 2, bool(s), True, False, 0, None, 0, [], {"em": float(s)} if em else {})
            for i, s in enumerate(solved)
        ]

    # 34 gained, 5 lost, 61 unchanged: p = 2 * sum_{k<=5} C(39, k) / 2^39 (by hand: 2 * 667928 / 2^39)
    before = evaluation([0] * 34 + [1] * 5 + [1] * 30 + [0] * 31)
    after = evaluation([1] * 34 + [0] * 5 + [1] * 30 + [0] * 31)
    gained, lost, p = paired_comparison(before, after)
    assert (gained, lost) == (34, 5) and p == pytest.approx(2 * 667928 / 2**39)
    assert paired_comparison(evaluation([0, 0, 0]), evaluation([1, 1, 1], em=False)) == (3, 0, 0.25)
    assert paired_comparison(evaluation([1, 0]), evaluation([1, 0])) == (0, 0, 1.0)  # nothing changed
    with pytest.raises(ValueError, match="not on the same items"):
        paired_comparison(evaluation([1, 0]), evaluation([1]))


def test_pass_at_k_by_hand_and_against_counting_every_k_subset():
    """Chen et al.'s estimator: a task of 4 episodes with 1 solved has pass@2 = 1 - C(3, 2) / C(4, 2)
    = 0.5; in general it is the share of k-subsets of a task's episodes holding a solved one."""

    def records(outcomes_per_task):
        out = []
        for task, outcomes in enumerate(outcomes_per_task):
            for solved in outcomes:
                out.append(EpisodeRecord(len(out), 7, task, float(solved), 1, bool(solved), True, False, 0, None, 0))
        return out

    assert pass_at_k(records([[1, 0, 0, 0], [0, 0, 0, 0]])) == {1: 0.125, 2: 0.25, 4: 0.5}
    rng = random.Random(0)
    tasks = [[rng.random() < 0.3 for _ in range(6)] for _ in range(5)]
    for k, value in pass_at_k(records(tasks)).items():
        subsets = [[any(c) for c in itertools.combinations(t, k)] for t in tasks]
        assert value == pytest.approx(sum(sum(s) / len(s) for s in subsets) / len(tasks))
    assert sorted(pass_at_k(records(tasks))) == [1, 2, 4, 6] and pass_at_k([]) == {}
    table = summarize(records([[1, 0, 0, 0], [0, 0, 0, 0]]), 1.0)
    rows = dict(line.rsplit(None, 1) for line in table.splitlines())
    assert [rows[f"pass@{k}"] for k in (1, 2, 4)] == ["0.125", "0.250", "0.500"]
    assert "pass@" not in summarize(records([[1], [0]]), 1.0)  # one episode per task: accuracy says it


def test_paired_comparison_takes_an_item_s_responses_as_its_solve_rate():
    """Four responses per item: item 0 goes from 3 of 4 solved to 1 of 4 (lost), item 1 from 1 to
    2 (gained), item 2 stays at 2. Keyed by item, only each item's last response counted before
    (2 gained, 0 lost for a mean that fell from 0.5 to 0.42)."""

    def evaluation(per_item):
        return [
            EpisodeRecord(4 * i + j, 7, i, float(s), 1, bool(s), True, False, 0, None, 0, [], {"em": float(s)})
            for i, outcomes in enumerate(per_item)
            for j, s in enumerate(outcomes)
        ]

    before = evaluation([[1, 1, 1, 0], [0, 0, 1, 0], [1, 1, 0, 0]])
    after = evaluation([[0, 0, 0, 1], [1, 0, 1, 0], [0, 0, 1, 1]])
    assert paired_comparison(before, after) == (1, 1, 1.0)


def test_format_followed_counts_an_episode_that_did_not_report_it_as_not_followed():
    """Where the env reports ``format_ok``, an episode whose last step did not (a rejected empty
    answer, a truncation) did not follow the format: 1 of 4 here, not 1 of the 2 that reported it.
    An env that never reports it gets n/a."""

    def record(format_ok):
        return EpisodeRecord(0, 0, None, 0.0, 1, False, True, False, 0, format_ok, 5)

    def followed(records):
        return next(line.split()[-1] for line in summarize(records, 1.0).splitlines() if "format followed" in line)

    assert followed([record(True), record(False), record(None), record(None)]) == "0.250"
    assert followed([record(None)]) == "n/a"


def test_an_episodes_max_length_defaults_to_the_context_and_never_passes_it():
    """``max_length`` was fixed at max(4096, 2 * max_new_tokens): a 16k model lost every prompt past
    4096 tokens (ToolUse-v0's median) and a 2k model aborted the run on the first long prompt."""
    assert episode_max_length(None, 16384) == 16383  # SGLang refuses prompt + max_new_tokens >= context
    assert episode_max_length(1000, 16384) == 1000
    assert episode_max_length(100_000, 2048) == 2047
    assert episode_max_length(None, None) == 4096 and episode_max_length(512, None) == 512
    for bad in (0, -5, 2.5, True, "long"):
        with pytest.raises(SystemExit, match="max_length must be a positive integer"):
            episode_max_length(bad, 2048)


def test_the_summary_counts_truncated_episodes_by_reason():
    def record(truncated, reason=None):
        info = {"truncated_reason": reason} if reason else {}
        return EpisodeRecord(0, 0, None, 0.0, 1, False, not truncated, truncated, 0, None, 5, [], info)

    def row(records):
        return next(line for line in summarize(records, 1.0).splitlines() if line.startswith("truncated"))

    records = [record(True, "max_length"), record(True, "max_length"), record(True, "max_turns"), record(False)]
    assert row(records).split(None, 1)[1] == "0.750 (max_length 2, max_turns 1)"
    assert row([record(False)]).split()[-1] == "0.000"


def test_default_outputs_of_two_runs_differ(monkeypatch):
    """Two runs started in the same second wrote into one file (named to the second)."""
    first = default_output("evaluate", "rl2/GuessTheNumber-v0", "org/model")
    monkeypatch.setattr(os, "getpid", lambda: -1)
    second = default_output("evaluate", "rl2/GuessTheNumber-v0", "org/model")
    assert first != second and first.startswith("runs/evaluate/rl2_GuessTheNumber-v0-org_model-")


def test_a_random_policy_is_the_runs_seed_for_an_env_without_its_own_sampler(tmp_path):
    """An env without ``sample_random_action`` played ``action_space.sample()`` unseeded: two runs
    with one seed played different actions."""
    import gymnasium as gym
    from toy_envs import UnicodeEchoEnv

    import rl2gem
    from rl2gem.evaluate import parse_args

    rl2gem.register("testlab/Echo-v0", "toy_envs:UnicodeEchoEnv")
    try:
        assert not hasattr(UnicodeEchoEnv, "sample_random_action")
        runs = []
        for name, seed in (("a", 3), ("b", 3), ("c", 4)):
            out = tmp_path / f"{name}.jsonl"
            args = ["env=testlab/Echo-v0", "policy=random", "n=3", f"seed={seed}", f"output={out}", "progress=false"]
            records = evaluate(parse_args(args))
            runs.append([[m["content"] for m in r.messages if m["role"] == "assistant"] for r in records])
            assert len(out.read_text().splitlines()) == 3
        assert runs[0] == runs[1] and runs[0] != runs[2]
        evaluate(parse_args(args))  # a second run into the same output rewrites it (it appended)
        assert len(out.read_text().splitlines()) == 3
    finally:
        del gym.registry["testlab/Echo-v0"]


@pytest.mark.parametrize("through", ["scripted", "openai"])
def test_an_evaluation_records_an_episode_whose_env_raised_and_goes_on(tmp_path, through, monkeypatch):
    import gymnasium as gym
    import openai

    import rl2gem
    from rl2gem.evaluate import parse_args
    from rl2gem.rollout import EnvError

    class Client:  # an API that answers "hi"
        def __init__(self, **options):
            message = SimpleNamespace(content="hi", tool_calls=None)
            reply = SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=None)
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=lambda **request: asyncio.sleep(0, reply)))

        async def close(self):
            pass

    monkeypatch.setattr(openai, "AsyncOpenAI", Client)
    rl2gem.register("testlab/Crash-v0", "toy_envs:EvenSeedCrashEnv")
    try:
        args = ["env=testlab/Crash-v0", "n=8", f"output={tmp_path / 'o.jsonl'}", "progress=false"]
        args += (
            ["policy=random"] if through == "scripted" else ["openai_base_url=http://127.0.0.1:9/v1", "openai_model=m"]
        )
        with pytest.warns(
            RuntimeWarning, match=r"(?s)testlab/Crash-v0 a?step \(seed \d+, turn 1\) raised ValueError.*Traceback"
        ):
            records = evaluate(parse_args(args))
        crashed = [r for r in records if r.seed % 2 == 0]
        assert 0 < len(crashed) < 8 and len(records) == 8 and len((tmp_path / "o.jsonl").read_text().splitlines()) == 8
        for record in records:
            assert (record.truncated, record.reward, record.turns) == (
                (True, 0.0, 1) if record in crashed else (False, 1.0, 1)
            )
        assert crashed[0].final_info["truncated_reason"] == "env_error"
        assert "ValueError: a bug on even seeds" in crashed[0].final_info["error"]
        assert crashed[0].messages[-1]["role"] == "assistant"  # the action the env failed on
        with pytest.raises(EnvError, match=r"testlab/Crash-v0 a?step \(seed \d+, turn 1\) raised ValueError"):
            evaluate(parse_args([*args, "env_errors=raise"]))
    finally:
        del gym.registry["testlab/Crash-v0"]


def test_a_server_that_is_gone_ends_the_evaluation_in_one_line(tmp_path):
    from rl2gem.evaluate import main

    output = tmp_path / "o.jsonl"
    common = ["n=2", "progress=false", f"output={output}"]
    with pytest.raises(
        SystemExit, match=r"^evaluate: APIConnectionError: Connection error. \(0 finished episodes written\)$"
    ):
        main(["openai_base_url=http://127.0.0.1:9/v1", "openai_model=m", "openai_max_retries=0", *common])
    served = ["env=rl2/Remote-v0", "env_kwargs.url=http://127.0.0.1:9", "env_kwargs.retries=0", *common]
    with pytest.raises(SystemExit, match=r"^evaluate: RemoteEnvError: http://127.0.0.1:9: GET /schema"):
        main(served)


def test_an_env_error_record_keeps_the_item_and_the_reward_so_far():
    """A data set's errored episode lost its index (paired comparisons then refused the runs), and
    the scripted and API paths recorded reward 0 where a rollout keeps the reward earned."""
    from omegaconf import OmegaConf

    from rl2gem.evaluation import _env_error_record

    cfg = OmegaConf.create({"env": "rl2/GSM8K-v0", "env_errors": "drop"})
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    with pytest.warns(RuntimeWarning, match="step .* raised OSError: gone"):
        record = _env_error_record(
            cfg, 5, (11, {"index": 3}), OSError("gone"), "step (seed 11, turn 1)", (messages, 7, 0.5), set()
        )
    assert (record.episode, record.seed, record.index, record.reward, record.turns) == (5, 11, 3, 0.5, 1)
    assert record.truncated and record.final_info["truncated_reason"] == "env_error"
