"""Math envs on real data: counts, oracle = checker agreement, user files, laziness."""

import json
import os
import subprocess
import sys

import gymnasium as gym
import pytest
from rl2gem.envs.math import MathEnv, load_problems

import rl2gem
from rl2gem import data
from rl2gem.data import DataUnavailable


@pytest.mark.parametrize(
    "dataset, split, count",
    [
        ("gsm8k", "test", 100),
        ("gsm8k", "train", 1660),
        ("math500", "test", 311),
        ("aime24", "test", 30),
        ("aime25", "test", 15),
    ],
)
def test_builtin_sources_have_the_expected_items(dataset, split, count):
    problems = load_problems(dataset, split)
    assert len(problems) == count
    assert all(p["question"] and p["answer"] for p in problems)
    assert len({p["id"] for p in problems}) == count


def test_gsm8k_originals_are_the_known_problems():
    test = load_problems("gsm8k", "test")
    shark = next(p for p in test if p["id"] == "gsm8k-473")
    assert "10-foot shark" in shark["question"] and shark["answer"] == "10"
    train_questions = {p["question"] for p in load_problems("gsm8k", "train")}
    assert not train_questions & {p["question"] for p in test}  # variants, not the originals


@pytest.mark.parametrize("env_id, n", [("rl2/MATH500-v0", 311), ("rl2/AIME24-v0", 30), ("rl2/AIME25-v0", 15)])
def test_reference_answers_verify_against_themselves(env_id, n):
    """The oracle scores 1.0 on every item: the data and the checker agree."""
    env = gym.make(env_id)
    solver = env.unwrapped.make_solver()
    for i in range(n):
        obs, _ = env.reset(options={"index": i})
        _, r, term, _, info = env.step(solver(obs))
        assert term and r == 1.0, (i, info)


def test_gsm8k_test_oracle_and_a_wrong_answer():
    env = gym.make("rl2/GSM8K-v0", split="test")
    assert len(env.unwrapped) == 100
    for i in range(100):
        obs, info = env.reset(options={"index": i})
        assert obs.startswith("Solve the following math problem") and info["index"] == i
        _, r, *_ = env.step(env.unwrapped.make_solver()(obs))
        assert r == 1.0
    env.reset(options={"index": 0})
    ref = env.unwrapped.problem["answer"]
    _, r, term, trunc, info = env.step(f"\\boxed{{{int(ref) + 1}}}")
    assert r == 0.0 and term and not info["correct"] and info["format_ok"] and info["reference"] == ref
    env.reset(options={"index": 0})
    _, r, term, _, info = env.step(f"I think it is {ref}.")  # right number, no box
    assert r == 0.0 and term and info["format_ok"] is False


def test_seeded_problem_order_is_reproducible():
    a, b = MathEnv("gsm8k", "test"), MathEnv("gsm8k", "test")
    a.reset(seed=5)
    b.reset(seed=5)
    assert [a.reset()[1]["index"] for _ in range(10)] == [b.reset()[1]["index"] for _ in range(10)]


def test_bad_splits_and_indices():
    with pytest.raises(ValueError, match="splits"):
        load_problems("math500", "train")
    with pytest.raises(ValueError, match="split"):
        MathEnv("gsm8k", "dev")
    with pytest.raises(IndexError):
        MathEnv("aime25", "test").reset(options={"index": 15})


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_user_files(tmp_path, fmt):
    import pandas as pd

    rows = [{"question": "What is 2+3?", "answer": "5"}, {"question": "Half of 1?", "answer": "\\frac{1}{2}"}]
    path = tmp_path / f"mine.{fmt}"
    df = pd.DataFrame(rows)
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path)
    env = rl2gem.make("rl2/Math-v0", dataset=str(path), split="test")
    env.reset(options={"index": 1})
    assert env.step("\\boxed{0.5}")[1] == 1.0
    assert len(env.unwrapped) == 2


def test_user_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "x", "a": "1"}))
    with pytest.raises(DataUnavailable, match="missing column"):
        load_problems(str(bad), "train")
    with pytest.raises(DataUnavailable, match="not found"):
        load_problems(str(tmp_path / "none.jsonl"), "train")
    with pytest.raises(DataUnavailable, match="split"):
        load_problems({"train": str(bad)}, "test")


def test_hub_name_without_hub_is_a_clear_error():
    # offline mode must be set before `datasets` is imported, hence a fresh interpreter
    code = (
        "from rl2gem.envs.math import load_problems\n"
        "try:\n    load_problems('some-org/some-math-set-that-is-not-cached', 'train')\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.startswith("DataUnavailable") and "pass the file path instead" in r.stdout, r.stderr


def test_making_many_envs_loads_nothing_until_reset(monkeypatch):
    calls = []
    real = data.prepared

    def counting(name, build):
        calls.append(name)
        return real(name, build)

    monkeypatch.setattr("rl2gem.envs.math.prepared", counting)
    venv = rl2gem.make_vec("rl2/AIME24-v0", 64)
    assert calls == []  # construction parses no file
    venv.reset(seed=0)
    assert len(calls) == 64 and len(set(calls)) == 1  # one data set, served from memory after the first
    assert len(data._memo) >= 1
    venv.close()


def test_a_refused_action_reports_no_answer_and_no_format():
    env = gym.make("rl2/GSM8K-v0")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("")
    assert reward == 0.0 and terminated and info["format_ok"] is False and info["correct"] is False
    assert info["reward_components"] == {"correctness": 0.0, "format": 0.0} and "reference" in info
