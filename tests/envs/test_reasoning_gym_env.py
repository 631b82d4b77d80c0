import dataclasses
import re
import time

import gymnasium as gym
import pytest
from rl2gem.envs.reasoning_gym import ReasoningGymEnv

import rl2gem


@pytest.mark.parametrize("task", ["countdown", "basic_arithmetic", "gsm_symbolic", "letter_counting"])
def test_oracle_scores_one_and_wrong_scores_zero_with_raw_partial_credit(task):
    env = ReasoningGymEnv(task)
    for seed in range(5):
        obs, info = env.reset(seed=seed)
        assert "<answer>" in obs and info["task"] == task
        _, r, term, _, info = env.step(env.make_solver()(obs))
        assert term and r == 1.0 and info["raw_score"] == 1.0
    env.reset(seed=0)
    _, r, _, _, info = env.step("<answer>definitely wrong 123456789</answer>")
    assert r == 0.0 and 0.0 <= info["raw_score"] < 1.0


def test_raw_reward_mode_passes_partial_credit_through():
    env = ReasoningGymEnv("countdown", reward="raw")
    env.reset(seed=1)
    _, r, _, _, info = env.step("<answer>1 + 1</answer>")
    assert 0.0 < r < 1.0 and r == info["raw_score"]  # reasoning-gym's partial credit for a wrong expression


def test_missing_tags_is_a_format_error():
    env = gym.make("rl2/Countdown-v0")
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step("the answer is 42")
    assert r == 0.0 and term and info["format_ok"] is False and info["invalid_action"]


def test_splits_differ_and_are_reproducible():
    train, test = ReasoningGymEnv("basic_arithmetic", "train"), ReasoningGymEnv("basic_arithmetic", "test")
    q_train = [train.reset(options={"index": i})[0] for i in range(20)]
    q_test = [test.reset(options={"index": i})[0] for i in range(20)]
    assert q_train != q_test
    assert q_train == [ReasoningGymEnv("basic_arithmetic", "train").reset(options={"index": i})[0] for i in range(20)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="did you mean"):
        ReasoningGymEnv("countdwn")
    with pytest.raises(ValueError, match="split"):
        ReasoningGymEnv("countdown", "dev")
    with pytest.raises(ValueError, match="reward"):
        ReasoningGymEnv("countdown", reward="shaped")


def test_instructions_replace_the_default_format_text():

    env = rl2gem.make(
        "rl2/ReasoningGym-v0", task="basic_arithmetic", instructions="Answer with just the number in <answer></answer>."
    )
    obs, _ = env.reset(seed=0)
    assert obs.endswith("Answer with just the number in <answer></answer>.") and "Think step by step" not in obs
    _, reward, *_ = env.step(f"<answer>{env.unwrapped.item['answer']}</answer>")
    assert reward == 1.0


ANSWER_MODES = {  # mode: (default instructions, a right reply, a wrong reply), {ref} is the answer
    "plain": ("Answer with just the final answer, nothing else.", "  {ref}\n", "The answer is {ref}"),
    "last_number": (
        "Answer with just the number.",
        "The sum is 12, so the answer is {ref}.",
        "{ref} is wrong; it is {ref}1",
    ),
}


@pytest.mark.parametrize("mode", sorted(ANSWER_MODES))
def test_answer_modes_score_the_reply(mode):
    """plain: the whole stripped reply; last_number: the last number in it."""

    instructions, right, wrong = ANSWER_MODES[mode]
    env = rl2gem.make("rl2/ReasoningGym-v0", task="basic_arithmetic", answer=mode, operators=["+", "-"])
    obs, _ = env.reset(seed=3)
    assert obs.endswith(instructions)
    ref = env.unwrapped.item["answer"]
    assert env.step(right.format(ref=ref))[1] == 1.0
    env.reset(seed=3)
    assert env.step(wrong.format(ref=ref))[1] == 0.0
    obs, _ = env.reset(seed=4)
    assert env.step(env.unwrapped.make_solver()(obs))[1] == 1.0


def test_answer_mode_errors_and_last_number_extraction():
    from rl2gem.envs.reasoning_gym import last_number

    with pytest.raises(ValueError, match="plain"):
        rl2gem.make("rl2/ReasoningGym-v0", answer="boxed")
    assert last_number("34 + 17 = 51.") == "51"
    assert last_number("5 - 9 = -4") == "-4"
    assert last_number("It is 1,234 apples") == "1234"
    assert last_number("no digits") is None
    # a hyphen after a word or a digit is not a minus sign: "pages 5-10" does not answer -10
    assert last_number("pages 5-10") == "10" and last_number("the zero-10 joke") == "10"
    assert last_number("x=-10") == "-10" and last_number("3.5") == "3.5" and last_number("答案是42") == "42"
    env = rl2gem.make("rl2/ReasoningGym-v0", task="basic_arithmetic", answer="last_number")
    env.reset(seed=5)
    _, reward, terminated, _, info = env.step("I do not know")
    assert reward == 0.0 and terminated and info["format_ok"] is False


def countdown_sum(env) -> str:
    """A wrong answer that passes countdown's check that the item's numbers are used."""
    return "+".join(map(str, env.unwrapped.item["metadata"]["numbers"]))


def test_an_answer_that_runs_python_reaches_nothing_on_the_host(tmp_path, monkeypatch):
    """Countdown's scorer evaluates the answer (sympy's parse_expr). With the refusal of scripted
    answers switched off, the code runs, in the sandbox: the file it writes is not on the host,
    and its forged score (printed, then exit) is not read."""
    from rl2gem.envs import reasoning_gym as module

    monkeypatch.setattr(module, "_SCRIPTED", re.compile(r"(?!)"))  # matches nothing
    env = gym.make("rl2/Countdown-v0")
    env.reset(seed=0)
    marker = tmp_path / "written-by-the-answer"
    payload = f"[__import__('os').system('touch {marker}'), {countdown_sum(env)}].pop()"
    _, reward, _, _, info = env.step(f"<answer>{payload}</answer>")
    assert not marker.exists() and reward == 0.0
    env.reset(seed=1)
    forged = f"[print(1.0), __import__('os')._exit(0), {countdown_sum(env)}].pop()"
    _, reward, _, _, info = env.step(f"<answer>{forged}</answer>")
    assert reward == 0.0 and info["raw_score"] == 0.0 and "scorer error" in info["answer"]


def test_an_answer_that_rewrites_its_scorer_is_refused_and_nothing_persists():
    env = gym.make("rl2/Countdown-v0")
    env.reset(seed=1)
    hack = f"[setattr(__import__('numpy'), 'isclose', eval('lambda *a, **k: True')), {countdown_sum(env)}].pop()"
    _, reward, _, _, info = env.step(f"<answer>{hack}</answer>")
    assert reward == 0.0 and "the answer is Python code" in info["answer"]
    for seed in range(2, 5):  # it patched numpy in the trainer's process: every later sum scored 1.0
        env.reset(seed=seed)
        assert env.step(f"<answer>{countdown_sum(env)}</answer>")[1] == 0.0


def test_a_scorer_past_its_time_limit_scores_zero(monkeypatch):
    from rl2gem.envs import reasoning_gym as module

    monkeypatch.setattr(module, "SCORING", dataclasses.replace(module.SCORING, timeout_s=2.0))
    env = ReasoningGymEnv("countdown")
    env.reset(seed=0)
    start = time.monotonic()
    _, reward, terminated, _, info = env.step("<answer>9**9**9**9</answer>")  # hung the step before
    assert time.monotonic() - start < 30 and reward == 0.0 and terminated and "timed out" in info["answer"]


@pytest.mark.parametrize("answer", ["<answer></answer>", "<answer> . </answer>"])
def test_an_empty_answer_gets_no_format_credit(answer):
    env = ReasoningGymEnv("countdown", reward="raw")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(answer)  # format 1.0 and a raw 0.01 before
    assert reward == 0.0 and terminated and info["format_ok"] is False
    assert info["reward_components"] == {"correctness": 0.0, "format": 0.0}


def test_a_refused_action_reports_the_scores_fields():
    env = ReasoningGymEnv("countdown")
    env.reset(seed=0)
    _, reward, _, _, info = env.step("   ")
    assert reward == 0.0 and info["raw_score"] == 0.0 and info["format_ok"] is False
    assert info["reward_components"] == {"correctness": 0.0, "format": 0.0} and "reference" in info


def test_only_tasks_that_evaluate_python_refuse_scripted_looking_answers():
    from rl2gem.envs.reasoning_gym import _evaluates_python

    assert _evaluates_python("countdown") and _evaluates_python("n_queens")
    assert not _evaluates_python("codeio")  # its answers may hold "__" (a codeio reference does)
    env = ReasoningGymEnv("letter_counting")
    env.reset(seed=0)
    _, _, _, _, info = env.step("<answer>__init__</answer>")  # a wrong answer, scored (not refused)
    assert "Python code" not in info["answer"]


def test_the_default_string_scorer_runs_in_process_and_a_tasks_own_scorer_in_the_sandbox(monkeypatch):
    from rl2gem.envs import reasoning_gym as module

    def no_sandbox(code, config):
        raise AssertionError("scored in the sandbox")

    monkeypatch.setattr(module, "run_python", no_sandbox)
    env = ReasoningGymEnv("basic_arithmetic")  # reasoning-gym's base score_answer: a string comparison
    obs, _ = env.reset(seed=0)
    assert env.step(env.make_solver()(obs))[1] == 1.0
    env = ReasoningGymEnv("countdown")  # its own scorer (sympy's parse_expr)
    obs, _ = env.reset(seed=0)
    with pytest.raises(AssertionError, match="scored in the sandbox"):
        env.step(env.make_solver()(obs))


def test_task_options_are_checked_when_the_env_is_made():
    """A misspelled or refused option failed at the first reset (after a trainer loaded its model);
    a task whose config has no ``validate`` (power_function, tsumego) still builds with options."""
    with pytest.raises(TypeError, match=r"task 'basic_arithmetic' has no option\(s\) \['min_term'\]"):
        rl2gem.make("rl2/ReasoningGym-v0", task="basic_arithmetic", min_term=2)
    with pytest.raises(ValueError, match=r"refused \{'min_terms': -3\}"):
        rl2gem.make("rl2/ReasoningGym-v0", task="basic_arithmetic", min_terms=-3)
    with pytest.raises(ValueError, match="size must be >= 1"):
        rl2gem.make("rl2/ReasoningGym-v0", size=0)
    env = rl2gem.make("rl2/ReasoningGym-v0", task="power_function", max_exponent=3)
    assert env.reset(seed=0)[0]
    rl2gem.make("rl2/ReasoningGym-v0", task="tsumego").close()
    env.close()


def test_codeio_items_are_made_in_the_sandbox_not_in_the_working_folder(tmp_path, monkeypatch, capfd):
    from rl2gem.envs.reasoning_gym import _dataset, _generation_runs_code

    assert _generation_runs_code("codeio") and not _generation_runs_code("countdown")
    monkeypatch.chdir(tmp_path)
    env = ReasoningGymEnv("codeio")
    # train items 447 and 1225 run snippets that write sailor_performance.csv and file_97.txt into
    # the working folder; 1408's snippet fails, and reasoning-gym prints its code to stdout
    for index in (447, 1225, 1408):
        env.reset(options={"index": index})
        assert env.item["question"] and "answer" in env.item
    assert list(tmp_path.iterdir()) == []
    assert "Error executing code" not in capfd.readouterr().out
    env.reset(options={"index": 3})  # a deterministic snippet: the item reasoning-gym makes in process
    reference = _dataset("codeio", "train", env.size, env.config)[3]
    assert (env.item["question"], env.item["answer"]) == (reference["question"], reference["answer"])
    _, reward, _, _, info = env.step(env.make_solver()(""))
    assert reward == 1.0 and info["raw_score"] == 1.0
