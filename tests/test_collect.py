"""python -m rl2gem.collect: SFT conversations from scripted policies or a model, in RL2's messages format."""

import json
import re

import pytest

from rl2gem.collect import _resolve, main, parse_args
from rl2gem.data import load_conversations
from rl2gem.rollout.tito import ChatRenderer

ROW_KEYS = {"messages", "reward", "env", "seed", "index", "policy"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


def collect(path, *args):
    """Run the CLI in-process; returns the rows written."""
    assert main([*args, f"output={path}", "progress=false"]) == 0
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def masked_texts(tokenizer, sequence):
    """Decoded runs of action-mask 1."""
    runs, current = [], []
    for token, mask in zip(sequence.input_ids + [None], sequence.action_mask + [0], strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current, skip_special_tokens=False, clean_up_tokenization_spaces=False))
            current = []
    return runs


def test_same_seed_same_bytes_other_seed_other_file(tmp_path):
    first, again, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    common = ("env=rl2/GuessTheNumber-v0", "policy=random", "n=8")
    collect(first, *common, "seed=0")
    collect(again, *common, "seed=0")
    collect(other, *common, "seed=1")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    solver_a, solver_b = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    collect(solver_a, "env=rl2/Mastermind-v0", "policy=solver", "n=3", "seed=5")
    collect(solver_b, "env=rl2/Mastermind-v0", "policy=solver", "n=3", "seed=5")
    assert solver_a.read_bytes() == solver_b.read_bytes()


def test_rows_are_rollout_conversations(tmp_path, tokenizer):
    rows = collect(
        tmp_path / "rows.jsonl",
        "env=rl2/GuessTheNumber-v0",
        "policy=solver",
        "n=4",
        "seed=10",
        "system_prompt=Guess well.",
    )
    assert len(rows) == 4
    assert [row["seed"] for row in rows] == [10, 11, 12, 13]  # an env without a data set plays seeds seed, seed+1, ...
    renderer = ChatRenderer(tokenizer)
    for row in rows:
        assert set(row) == ROW_KEYS
        assert (row["env"], row["policy"], row["index"], row["reward"]) == (
            "rl2/GuessTheNumber-v0",
            "solver",
            None,
            1.0,
        )
        roles = [m["role"] for m in row["messages"]]
        turns = roles.count("assistant")
        # system, then user / assistant alternating, ending with the last action (as a Rollout records it)
        assert roles == ["system"] + ["user", "assistant"] * turns
        assert row["messages"][0]["content"] == "Guess well."
        actions = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert masked_texts(tokenizer, renderer.conversation(row["messages"])) == [a + "<|im_end|>" for a in actions]
    assert load_conversations(str(tmp_path / "rows.jsonl")) == [row["messages"] for row in rows]


def test_min_reward_keeps_exactly_the_episodes_that_reach_it(tmp_path, capsys):
    common = ("env=rl2/GuessTheNumber-Easy-v0", "policy=random", "n=20", "seed=3")
    everything = collect(tmp_path / "all.jsonl", *common)
    assert len(everything) == 20
    capsys.readouterr()
    kept = collect(tmp_path / "kept.jsonl", *common, "min_reward=1.0")
    printed = capsys.readouterr().out
    assert kept == [row for row in everything if row["reward"] >= 1.0]  # same episodes, filtered
    assert 0 < len(kept) < 20
    assert re.search(rf"played 20 episodes, kept {len(kept)} with reward >= 1\.0", printed), printed


def test_search_qa_solver_rows_train_as_one_sequence(tmp_path, tokenizer):
    path = tmp_path / "search.jsonl"
    rows = collect(path, "env=rl2/SearchQA-v0", "policy=solver", "split=train", "n=5")
    assert len(rows) == 5 and [row["index"] for row in rows] == [0, 1, 2, 3, 4]  # data set items in order
    conversations = load_conversations(str(path))
    assert conversations == [row["messages"] for row in rows]
    renderer = ChatRenderer(tokenizer)
    for row, messages in zip(rows, conversations, strict=True):
        assert row["reward"] == 1.0
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        search, answer = messages[1]["content"], messages[3]["content"]
        assert re.fullmatch(r"<search>.+</search>", search) and re.fullmatch(r"<answer>.+</answer>", answer)
        assert messages[2]["content"].startswith("<information>")
        sequence = renderer.conversation(messages)
        assert masked_texts(tokenizer, sequence) == [search + "<|im_end|>", answer + "<|im_end|>"]


def test_tool_results_are_one_tool_message_each(tmp_path, tokenizer):
    rows = collect(tmp_path / "tools.jsonl", "env=rl2/ToolUse-v0", "policy=solver", "n=2")
    renderer = ChatRenderer(tokenizer)
    for row in rows:
        messages = row["messages"]
        assert messages[-1]["role"] == "assistant"
        for position, message in enumerate(messages):
            if message["role"] != "assistant" or position + 1 == len(messages):
                continue
            following = 0
            while messages[position + 1 + following]["role"] == "tool":
                following += 1
            # every <tool_call> of an action gets its own tool message; a reply without calls gets none
            assert following == message["content"].count("<tool_call>")
        assert any(m["role"] == "tool" for m in messages)
        actions = [m["content"] for m in messages if m["role"] == "assistant"]
        assert masked_texts(tokenizer, renderer.conversation(messages)) == [a + "<|im_end|>" for a in actions]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy=model"], "policy=model needs model="),
        (["policy=solver", "model=smollm2-135m-instruct"], "does not use model="),
        (["policy=greedy"], "unknown policy 'greedy'"),
        (["tools_in_template=true"], "tools_in_template"),
        (["n=0"], "n must be >= 1"),
        (["min_rewrd=1"], "did you mean 'min_reward'"),
    ],
)
def test_bad_arguments_exit_with_a_reason(tmp_path, args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([*args, f"output={tmp_path / 'x.jsonl'}", "progress=false"])
    assert message in f"{stopped.value.code} {capsys.readouterr().err}"  # config errors: on stderr, code 2
    assert not (tmp_path / "x.jsonl").exists()


def test_policy_and_temperature_defaults():
    assert _resolve(parse_args(["output=x"])).policy == "solver"
    model = _resolve(parse_args(["model=smollm2-135m-instruct", "output=x"]))
    assert (model.policy, model.temperature, model.split) == ("model", 1.0, "train")  # sampling, train split
    assert _resolve(parse_args(["policy=model", "model=m", "temperature=0.3", "output=x"])).temperature == 0.3


def test_model_rejection_sampling_rows_tokenise(tmp_path, tokenizer, tiny_dir, monkeypatch):
    """On the tiny random Llama (SmolLM2's tokenizer): the README's collect command runs the real model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path, again = tmp_path / "model.jsonl", tmp_path / "again.jsonl"
    args = (
        "env=rl2/GuessTheNumber-Easy-v0",
        "policy=model",
        f"model={tiny_dir}",
        "n=2",
        "batch_size=2",
        "max_new_tokens=12",
        "min_reward=0.0",
    )
    rows = collect(path, *args)
    collect(again, *args)
    assert path.read_bytes() == again.read_bytes()  # sampled (temperature 1.0) with per-episode seeds
    assert len(rows) == 2  # every reward is >= 0
    renderer = ChatRenderer(tokenizer)
    for row, messages in zip(rows, load_conversations(str(path)), strict=True):
        assert set(row) == ROW_KEYS | {"model"} and (row["policy"], row["model"]) == ("model", str(tiny_dir))
        assert messages[-1]["role"] == "assistant"
        sequence = renderer.conversation(messages)
        assert sum(sequence.action_mask) > 0 and len(sequence.input_ids) == len(sequence.action_mask)


def _record(position, reward, reply, prompt="What is 2 + 3?"):
    from rl2gem.evaluation import EpisodeRecord

    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return EpisodeRecord(position, 7, 3, reward, 1, reward > 0, True, False, 0, None, 4, messages)


def test_pair_rows_take_the_best_and_worst_episode_of_each_task():
    from rl2gem.collect import pair_rows

    cfg = _resolve(parse_args(["model=m", "pairs=true", "output=x"]))
    assert (cfg.responses_per_prompt, cfg.temperature) == (4, 1.0)
    records = [_record(i, r, f"reply {i}") for i, r in enumerate([0.0, 1.0, 0.5, 1.0])]  # task 1
    records += [_record(4 + i, 1.0, "5") for i in range(4)]  # task 2: all rewarded, no pair
    multi = [
        {"role": "user", "content": "Guess"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Higher"},
        {"role": "assistant", "content": "3"},
    ]
    records += [_record(8 + i, float(i == 2), "1") for i in range(4)]  # task 3: a multi-turn winner
    records[10].messages = multi
    rows = pair_rows(records, cfg)
    assert len(rows) == 2
    assert rows[0]["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert (rows[0]["chosen"], rows[0]["rejected"]) == ("reply 1", "reply 0")  # first of the best, first of the worst
    assert (rows[0]["chosen_reward"], rows[0]["rejected_reward"]) == (1.0, 0.0)
    assert rows[1]["chosen"] == multi[1:] and rows[1]["rejected"] == "1"
    assert {"env", "seed", "index", "model", "policy"} <= set(rows[0])
    strict = _resolve(parse_args(["model=m", "pairs=true", "min_reward=0.5", "output=x"]))  # rejected below 0.5
    assert len(pair_rows(records[:4], strict)) == 1 and pair_rows(records[1:3], strict) == []


def test_pairs_need_a_model_and_groups():
    with pytest.raises(SystemExit, match="policy=model"):
        _resolve(parse_args(["pairs=true", "output=x"]))
    with pytest.raises(SystemExit, match="responses_per_prompt >= 2"):
        _resolve(parse_args(["model=m", "pairs=true", "responses_per_prompt=1", "output=x"]))


def test_a_crash_keeps_the_rows_of_the_episodes_before_it(tmp_path, monkeypatch):
    """Rows are written as episodes end: an env that fails at the 8th reset leaves the first 7
    (``env_errors=raise``); by default the 11 others are written."""
    from rl2gem import evaluation as evaluate_module

    common = ("env=rl2/GuessTheNumber-Easy-v0", "policy=solver", "n=12", "seed=5")
    everything = collect(tmp_path / "all.jsonl", *common)
    make_env = evaluate_module._make_env

    def failing_env(cfg):
        env = make_env(cfg)
        reset, calls = env.reset, []

        def reset_then_fail(**kw):
            calls.append(1)
            if len(calls) == 8:
                raise RuntimeError("the env's back-end went away")
            return reset(**kw)

        env.reset = reset_then_fail
        return env

    monkeypatch.setattr(evaluate_module, "_make_env", failing_env)
    path = tmp_path / "crashed.jsonl"
    with pytest.raises(RuntimeError, match="went away"):
        main([*common, f"output={path}", "progress=false", "env_errors=raise"])
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == everything[:7]
    # by default the failed episode is counted, not written, and the run goes on
    with pytest.warns(RuntimeWarning, match="went away"):
        main([*common, f"output={path}", "progress=false"])
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == everything[:7] + everything[8:]


def test_a_refused_run_leaves_an_existing_output_as_it_was(tmp_path):
    """The output was opened (emptied) before evaluate's own checks: an unknown env, a bad
    max_length... wiped the file a previous run had written."""
    output = tmp_path / "precious.jsonl"
    output.write_text('{"kept": true}\n', encoding="utf-8")
    for bad in ("env=rl2/NoSuchEnv-v0", "max_length=-3"):
        with pytest.raises((SystemExit, Exception)):
            main(["env=rl2/GuessTheNumber-v0", "policy=random", "n=2", bad, f"output={output}", "progress=false"])
        assert output.read_text(encoding="utf-8") == '{"kept": true}\n', bad
    assert collect(output, "env=rl2/GuessTheNumber-v0", "policy=random", "n=2") != [{"kept": True}]


def test_failed_episodes_are_counted_not_written(tmp_path, capsys):
    from rl2gem.collect import _RowWriter
    from rl2gem.evaluation import EpisodeRecord

    def record(episode, info):
        messages = [{"role": "user", "content": "" if info else "Guess."}, {"role": "assistant", "content": "5"}]
        return EpisodeRecord(episode, episode, episode, 0.0, 1, False, True, False, 0, None, 1, messages, info)

    cfg = _resolve(parse_args(["env=rl2/GuessTheNumber-v0", "policy=random", f"output={tmp_path / 'o.jsonl'}"]))
    writer = _RowWriter(tmp_path / "o.jsonl", cfg)
    writer(record(0, {}))
    writer(record(1, {"error": "ClientConnectorError: the env server went away"}))
    writer(record(2, {"truncated_reason": "remote_error"}))
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == [0] and writer.failed == 2


def test_a_served_model_plays_as_policy_model_and_the_openai_api_is_refused():
    cfg = _resolve(parse_args(["env=rl2/GuessTheNumber-v0", "server=http://127.0.0.1:1"]))
    assert cfg.policy == "model" and cfg.temperature == 1.0  # was "solver", sampling at 0
    with pytest.raises(SystemExit, match="openai_base_url= .* is not supported by collect"):
        _resolve(parse_args(["env=rl2/ToolUse-v0", "openai_base_url=http://127.0.0.1:1/v1", "openai_model=m"]))
    with pytest.raises(SystemExit, match="policy=random does not use server="):
        _resolve(parse_args(["env=rl2/GuessTheNumber-v0", "policy=random", "server=http://127.0.0.1:1"]))
