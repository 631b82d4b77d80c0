"""DPO: the loss and gradients equal TRL's on the same inputs, 2 ranks == 1 rank, resume equality,
and reference log-probs read from the data."""

import copy
import json

import pytest
import torch
from helpers import logged_steps, stop_and_resume, torchrun
from rl2gem.trainers import dpo
from safetensors.torch import load_file
from tiny import tiny_model

from rl2gem.algorithms import dpo_loss
from rl2gem.training.forward import sequence_sums, token_logprobs


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_gradients_equal_trl(tiny_dir, loss_type, tmp_path):
    """TRL's DPOTrainer computes its loss on its own padded batch; ours packs the same token ids
    (chosen_0, rejected_0, chosen_1, ...) with the same completion masks: same loss, same gradients."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy, reference = tiny_model(0), tiny_model(1)  # a reference unlike the policy: non-zero log-ratios
    ours, our_reference = copy.deepcopy(policy).train(), copy.deepcopy(reference)
    data = Dataset.from_list(
        [
            {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6 or so"},
            {"prompt": "Name a colour.", "chosen": " Red, I think.", "rejected": " Seven"},
        ]
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        beta=0.3,
        loss_type=[loss_type],
        report_to=[],
        per_device_train_batch_size=2,
        use_cpu=True,
        bf16=False,  # TRL's default autocasts to bfloat16; both sides run float32
        save_strategy="no",
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, batch, False)
    trl_loss.backward()

    real = batch["attention_mask"].bool()
    rows = [(batch["input_ids"][i][real[i]].tolist(), batch["completion_mask"][i][real[i]].tolist()) for i in range(4)]
    rows = [rows[0], rows[2], rows[1], rows[3]]  # TRL: all chosen then all rejected; ours: pair by pair

    def logps(model):
        values, _ = token_logprobs(model, [ids for ids, _ in rows], torch.device("cpu"))
        return sequence_sums(values, [len(ids) for ids, _ in rows], [mask for _, mask in rows])

    with torch.no_grad():
        reference_logps = logps(our_reference)
    policy_logps = logps(ours)
    counts = torch.tensor([float(sum(mask)) for _, mask in rows])
    losses, _, _ = dpo_loss(
        policy_logps[0::2],
        policy_logps[1::2],
        reference_logps[0::2],
        reference_logps[1::2],
        beta=0.3,
        loss_type=loss_type,
        chosen_tokens=counts[0::2],
        rejected_tokens=counts[1::2],
    )
    losses.mean().backward()
    assert float(losses.mean().detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5)
    assert abs(float(trl_loss.detach()) - 0.693147) > 0.05  # a loss away from the tie, where gradients say something
    for (name, mine), theirs in zip(ours.named_parameters(), policy.parameters(), strict=True):
        scale = theirs.grad.abs().max().item()
        assert (mine.grad - theirs.grad).abs().max().item() <= 1e-5 * scale + 1e-9, name


def test_config_errors_name_the_key(tmp_path, capsys):
    data = tmp_path / "x.jsonl"
    data.write_text("")
    assert dpo.main([f"data.train={data}", "dpo.loss_type=hinge"]) == 2
    assert "dpo.loss_type" in capsys.readouterr().err
    assert dpo.main([f"data.train={data}", "actor.packing=trie"]) == 2
    assert "actor.packing" in capsys.readouterr().err


ARGS = ["data.batch_size=8", "actor.lr=1e-3", "trainer.progress=false", "actor.max_length_per_device=128"]


def weights(run, step):
    return load_file(run / f"checkpoint-{step}" / "hf" / "model.safetensors")


# slow: the loss: test_loss_and_gradients_equal_trl; 2 ranks and resume: test_ppo.py's FSDP and kill -9 tests (same Worker, Checkpointer)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_equal_one_and_resume_equals_an_uninterrupted_run(tiny_dir, pairs_file, tmp_path):
    """One rank with flat packing against two ranks with prefix-tree packing (each pair's prompt
    once): the same losses, rewards and weights; a resumed tree run equals the uninterrupted one."""
    data = [f"data.train={pairs_file}", f"data.test={pairs_file}", f"actor.model={tiny_dir}", *ARGS]
    tree = [*data, "actor.packing=tree"]
    torchrun(1, "trainers/dpo.py", *data, "trainer.total_steps=4", f"trainer.output_dir={tmp_path / 'one'}")
    torchrun(2, "trainers/dpo.py", *tree, "trainer.total_steps=4", f"trainer.output_dir={tmp_path / 'two'}")
    stop_and_resume(2, "trainers/dpo.py", tree, 2, 4, tmp_path / "cut")
    one, two, cut = (logged_steps(tmp_path / run / "metrics.jsonl", "train/loss") for run in ("one", "two", "cut"))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    assert one[1]["train/loss"] == pytest.approx(0.693147, abs=1e-5)  # the policy is the reference at step 1
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)
    for step in (3, 4):
        assert cut[step]["train/loss"] == pytest.approx(two[step]["train/loss"], rel=1e-5)
    evals = logged_steps(tmp_path / "one" / "metrics.jsonl", "eval/loss")
    assert evals[4]["eval/loss"] < evals[0]["eval/loss"] and evals[4]["eval/rewards/accuracies"] > 0.5
    for name, t in weights(tmp_path / "one", 4).items():
        assert (t - weights(tmp_path / "two", 4)[name]).abs().max().item() < 1e-4, name
        assert (t - weights(tmp_path / "cut", 4)[name]).abs().max().item() < 1e-5, name


@pytest.mark.timeout(900)
def test_reference_log_probs_from_the_data(tiny_dir, pairs_file, tmp_path):
    """Rows with ref_chosen_logps / ref_rejected_logps need no reference model: with references of
    0 the implicit rewards are beta times the policy's own log-probs."""
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    given = tmp_path / "given.jsonl"
    given.write_text(
        "".join(json.dumps({**r, "ref_chosen_logps": 0.0, "ref_rejected_logps": 0.0}) + "\n" for r in rows)
    )
    out = tmp_path / "run"
    stdout = torchrun(
        1,
        "trainers/dpo.py",
        f"data.train={given}",
        f"data.test={given}",
        f"actor.model={tiny_dir}",
        *ARGS,
        "dpo.beta=0.5",
        "trainer.total_steps=1",
        f"trainer.output_dir={out}",
    )
    assert "dpo: reference log-probs from the data" in stdout  # no reference model was loaded
    first = logged_steps(out / "metrics.jsonl", "eval/loss")[0]
    assert first["eval/rewards/chosen"] == pytest.approx(0.5 * first["eval/logps/chosen"], rel=1e-5)
    assert first["eval/rewards/rejected"] == pytest.approx(0.5 * first["eval/logps/rejected"], rel=1e-5)
    # some rows without: the frozen model (here the policy itself) gives every pair its references,
    # the data's are not mixed in (they were: the rows with 0 had rewards of beta times the log-probs)
    half = tmp_path / "half.jsonl"
    half.write_text(
        "".join(
            json.dumps({**r, **({"ref_chosen_logps": 0.0, "ref_rejected_logps": 0.0} if i % 2 else {})}) + "\n"
            for i, r in enumerate(rows)
        )
    )
    stdout = torchrun(
        1, "trainers/dpo.py", f"data.train={half}", f"data.test={half}", f"actor.model={tiny_dir}", *ARGS,
        "dpo.beta=0.5", "trainer.total_steps=1", f"trainer.output_dir={tmp_path / 'half'}",
    )  # fmt: skip
    assert "dpo: reference log-probs from the frozen model" in stdout
    first = logged_steps(tmp_path / "half" / "metrics.jsonl", "eval/loss")[0]
    assert first["eval/rewards/chosen"] == pytest.approx(0.0, abs=1e-5) != first["eval/logps/chosen"]
    # a ref.model given is the reference even when every row has its own (they were used silently)
    stdout = torchrun(
        1, "trainers/dpo.py", f"data.train={given}", f"data.test={given}", f"actor.model={tiny_dir}", *ARGS,
        f"ref.model={tiny_dir}", "dpo.beta=0.5", "trainer.total_steps=1", f"trainer.output_dir={tmp_path / 'ref'}",
    )  # fmt: skip
    assert "the rows' ref_chosen_logps and ref_rejected_logps are not used" in stdout
    first = logged_steps(tmp_path / "ref" / "metrics.jsonl", "eval/loss")[0]
    assert first["eval/rewards/chosen"] == pytest.approx(0.0, abs=1e-5) != first["eval/logps/chosen"]
