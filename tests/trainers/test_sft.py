"""The SFT trainer: config errors, the assistant-only mask, 2 ranks == 1 rank, resume equality, and
its env evaluation equal to ``python -m rl2gem.evaluate`` on the exported checkpoint."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, logged_steps, masked_runs, stop_and_resume, torchrun
from rl2gem.trainers import sft
from safetensors.torch import load_file


@pytest.fixture(scope="session")
def episodes(tmp_path_factory):
    """Multi-turn solver episodes of GuessTheNumber, written by ``python -m rl2gem.collect``."""
    out = tmp_path_factory.mktemp("data") / "episodes.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl2gem.collect",
            "env=rl2/GuessTheNumber-Easy-v0",
            "policy=solver",
            "n=12",
            f"output={out}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_config_errors_name_the_key(tmp_path, capsys):
    assert sft.main([]) == 2
    assert "data.train is required" in capsys.readouterr().err
    data = tmp_path / "x.jsonl"
    data.write_text("")
    assert sft.main([f"data.train={data}", "actor.loss_agg=sum"]) == 2
    assert "actor.loss_agg" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hi")
    for argument, message in [
        (f"data.train={tmp_path / 'nope.jsonl'}", "data.train: no such data file"),
        (f"data.train={tmp_path / 'chat.txt'}", "data.train: no such data file"),
        (f"data.train={tmp_path / 'notes.txt'}", "data.train: '"),  # ... is not a file format rl2gem reads
        (f"data.train=[{data}]", "data.train: expected a file, a dataset name or {split: file}, got ["),
        (f"data.train={{train:{data}}}", "data.train: no file for ['train:"),  # no space after the colon
        (f"data.train={{tran: {data}}}", "data.train: the splits of a {split: file} mapping are"),
        (f"data.test=a/b/{tmp_path.name}", "data.test: no such data file"),
    ]:
        assert sft.main([f"data.train={data}", argument] if argument.startswith("data.test") else [argument]) == 2
        assert capsys.readouterr().err.startswith(f"config error: {message}"), argument
    # the evaluation env is built once before anything loads: an argument it refuses is named
    evaluation = [f"data.train={data}", "trainer.eval_env=rl2/GuessTheNumber-v0", "trainer.eval_env_kwargs.max_turn=3"]
    assert sft.main(evaluation) == 2
    assert capsys.readouterr().err.startswith(
        "config error: trainer.eval_env_kwargs: rl2/GuessTheNumber-v0 with {'max_turn': 3}: TypeError"
    )


def test_assistant_only_mask_with_the_smollm2_template():
    """A hand-built two-turn conversation: exactly the assistant replies (and their end-of-turn
    token) carry the loss; the cut to max_length keeps the first tokens."""
    from rl2gem.trainers.sft import tokenize
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model
    from rl2gem.rollout.tito import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess a number from 1 to 4."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Higher."},
        {"role": "assistant", "content": "Is it 3?"},
    ]
    (sample,) = tokenize(ChatRenderer(tokenizer), [conversation], 1024)
    assert [tokenizer.decode(s) for s in masked_runs(sample.ids, sample.mask)] == ["2<|im_end|>", "Is it 3?<|im_end|>"]
    assert tokenizer.decode(sample.ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    with pytest.warns(UserWarning, match=r"data.max_length=\d+: 1 of 1 conversations cut to it .*, 0 dropped"):
        (cut,) = tokenize(ChatRenderer(tokenizer), [conversation], len(sample.ids) - 3)
    assert cut.ids == sample.ids[:-3] and sum(cut.mask) == sum(sample.mask) - 3
    with pytest.warns(UserWarning, match=r"data.max_length=10: 1 of 1 conversations cut to it .*, 1 dropped"):
        assert tokenize(ChatRenderer(tokenizer), [conversation], 10) == []  # no assistant token left


# slow: 2 ranks: test_ppo.py's FSDP equivalence (same Worker); the env evaluation: the README's agentic short form
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_equal_one_and_eval_equals_the_cli(tiny_dir, episodes, tmp_path):
    """Same losses and weights on 1 and 2 ranks; the trainer's env evaluation equals
    ``python -m rl2gem.evaluate`` on the Hugging Face export with the same settings."""
    args = [
        f"data.train={episodes}",
        f"data.test={episodes}",
        f"actor.model={tiny_dir}",
        "data.batch_size=6",
        "actor.lr=1e-3",
        "trainer.total_steps=3",
        "trainer.eval_at_start=false",
        "trainer.progress=false",
        "actor.max_length_per_device=256",
    ]
    torchrun(1, "trainers/sft.py", *args, f"trainer.output_dir={tmp_path / 'one'}")
    torchrun(
        2,
        "trainers/sft.py",
        *args,
        f"trainer.output_dir={tmp_path / 'two'}",
        "trainer.eval_env=rl2/GuessTheNumber-Easy-v0",
        "trainer.eval_n=5",
        "rollout.max_new_tokens=6",
    )
    one, two = (
        logged_steps(tmp_path / "one" / "metrics.jsonl", "train/loss"),
        logged_steps(tmp_path / "two" / "metrics.jsonl", "train/loss"),
    )
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert one[3]["train/loss"] < one[1]["train/loss"]  # it learns
    for s in (1, 2, 3):
        assert two[s]["train/loss"] == pytest.approx(one[s]["train/loss"], rel=1e-4)
    wa = load_file(tmp_path / "one" / "checkpoint-3" / "hf" / "model.safetensors")
    wb = load_file(tmp_path / "two" / "checkpoint-3" / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name, t in wa.items():
        assert (t - wb[name]).abs().max().item() < 1e-4, name
    final = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["eval/episodes"] == 5 and "eval/loss" in final
    out = tmp_path / "cli.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl2gem.evaluate",
            "env=rl2/GuessTheNumber-Easy-v0",
            "n=5",
            "seed=0",
            f"model={tmp_path / 'two' / 'checkpoint-3' / 'hf'}",
            "max_new_tokens=6",
            f"output={out}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert final["eval/response_tokens"] == pytest.approx(sum(x["generated_tokens"] for x in records) / 5)
    assert final["eval/turns"] == pytest.approx(sum(x["turns"] for x in records) / 5)
    assert final["eval/reward"] == pytest.approx(sum(x["reward"] for x in records) / 5)


# slow: resume: test_ppo.py's kill -9 test (same Checkpointer)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_matches_an_uninterrupted_run(tiny_dir, episodes, tmp_path):
    """Stop after step 2 (its checkpoint), resume to step 4: the same losses and weights as 4 steps in one go."""
    args = [
        f"data.train={episodes}",
        f"actor.model={tiny_dir}",
        "data.batch_size=4",
        "actor.lr=1e-3",
        "trainer.eval_at_start=false",
        "trainer.progress=false",  # actor.max_length_per_device: the default, auto (4096 on the CPU)
    ]
    torchrun(2, "trainers/sft.py", *args, "trainer.total_steps=4", f"trainer.output_dir={tmp_path / 'full'}")
    stop_and_resume(2, "trainers/sft.py", args, 2, 4, tmp_path / "cut")
    full, cut = (
        logged_steps(tmp_path / "full" / "metrics.jsonl", "train/loss"),
        logged_steps(tmp_path / "cut" / "metrics.jsonl", "train/loss"),
    )
    assert len({full[s]["train/loss"] for s in full}) == 4  # batches differ from step to step (12 episodes, 4 per step)
    assert all(full[s]["actor/max_length_per_device"] == 4096 for s in full)
    for s in (3, 4):
        assert cut[s]["train/loss"] == pytest.approx(full[s]["train/loss"], rel=1e-5)
        assert cut[s]["actor/lr"] == full[s]["actor/lr"]
    wa = load_file(tmp_path / "full" / "checkpoint-4" / "hf" / "model.safetensors")
    wb = load_file(tmp_path / "cut" / "checkpoint-4" / "hf" / "model.safetensors")
    for name, t in wa.items():
        assert (t - wb[name]).abs().max().item() < 1e-5, name


def test_model_parallel_ranks_log_one_rank_s_loss_and_their_share_of_the_flops(tiny_dir, episodes, tmp_path):
    """Sequence and tensor parallelism over 2 ranks log the loss of one rank, and MFU from each
    rank's half of the work: every rank of an SP or TP group holds the whole loss and counts the
    whole micro-batch's tokens, so summing over ranks had doubled both. With the peak fixed
    (``trainer.peak_flops``), ``perf/mfu * time/step`` is the FLOPs per rank."""
    args = [
        f"data.train={episodes}",
        f"actor.model={tiny_dir}",
        "data.batch_size=6",
        "trainer.total_steps=1",
        "trainer.eval_at_start=false",
        "trainer.progress=false",
        "trainer.peak_flops=1e12",
        "actor.max_length_per_device=256",
    ]
    torchrun(1, "trainers/sft.py", *args, f"trainer.output_dir={tmp_path / 'one'}")
    one = logged_steps(tmp_path / "one" / "metrics.jsonl", "train/loss")[1]
    one_flops = one["perf/mfu"] * one["time/step"]
    for layout in ("sp_size", "tp_size"):
        out = tmp_path / layout
        torchrun(2, "trainers/sft.py", *args, f"actor.{layout}=2", f"trainer.output_dir={out}")
        two = logged_steps(out / "metrics.jsonl", "train/loss")[1]
        assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-4), layout
        assert two["perf/mfu"] * two["time/step"] == pytest.approx(one_flops / 2, rel=0.1), layout


def test_the_held_out_items_come_from_data_test_or_the_train_mapping():
    from omegaconf import OmegaConf

    from rl2gem.training.offline import held_out

    def data(train, test=None):
        return OmegaConf.create({"train": train, "test": test})

    assert held_out(data("a.jsonl")) == (None, "test")
    assert held_out(data("a.jsonl", "b.jsonl")) == ("b.jsonl", "test")
    mapping = {"train": "a.jsonl", "validation": "v.jsonl"}
    assert held_out(data(mapping)) == (mapping, "validation")  # the train mapping's held-out file
    assert held_out(data(mapping, "b.jsonl")) == ("b.jsonl", "test")  # data.test wins
    assert held_out(data("a.jsonl", {"test": "t.jsonl"})) == ({"test": "t.jsonl"}, "test")
    interpolated = OmegaConf.create({"folder": "runs", "train": "a.jsonl", "test": "${folder}/t.jsonl"})
    assert held_out(interpolated) == ("runs/t.jsonl", "test")  # a new string at each access: kept


def test_no_steps_is_one_evaluation_of_the_start_and_no_checkpoint(tiny_dir, episodes, tmp_path, capsys):
    """``trainer.total_steps=0`` (a baseline's evaluation) evaluated the start twice and wrote a full
    copy of the start model as ``checkpoint-0`` (2.2 GB for SmolLM2)."""
    out = tmp_path / "zero"
    arguments = [f"data.train={episodes}", f"actor.model={tiny_dir}", "trainer.total_steps=0", "trainer.eval_n=2"]
    arguments += ["trainer.eval_env=rl2/GuessTheNumber-Easy-v0", f"trainer.output_dir={out}", "trainer.progress=false"]
    assert sft.main(arguments) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval/success" in row] == [0]
    assert not list(out.glob("checkpoint-*")) and not (out / "latest").exists()
    assert "checkpoint: none (no step trained)" in capsys.readouterr().out
