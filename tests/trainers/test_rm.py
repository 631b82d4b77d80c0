"""The reward-model trainer: 2 ranks == 1 rank, the export is a transformers sequence classifier
that gives the training scores, RewardModel scores episodes (replace / add), and PPO runs on it."""

import copy
import json
import shutil

import pytest
import torch
from helpers import logged_steps, torchrun
from rl2gem.trainers import rm
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from rl2gem.data import load_preferences
from rl2gem.rollout import RolloutBatch
from rl2gem.rollout.tito import ChatRenderer, Episode, Sequence
from rl2gem.training import RewardModel
from rl2gem.training.pairs import tokenize_pairs
from rl2gem.training.worker import scoring_padding

ARGS = [
    "data.batch_size=8",
    "actor.lr=1e-3",
    "trainer.total_steps=3",
    "trainer.progress=false",
    "actor.max_length_per_device=128",
]


@pytest.fixture(scope="session")  # built once per test process, however its tests are interleaved
def runs(tiny_dir, pairs_file, tmp_path_factory):
    """The same 3 steps on 1 and on 2 ranks, evaluated on the pairs."""
    out = tmp_path_factory.mktemp("rm")
    data = [f"data.train={pairs_file}", f"data.test={pairs_file}", f"actor.model={tiny_dir}", *ARGS]
    torchrun(1, "trainers/rm.py", *data, f"trainer.output_dir={out / 'one'}")
    torchrun(2, "trainers/rm.py", *data, f"trainer.output_dir={out / 'two'}")
    return out


def test_config_errors_name_the_key(capsys):
    assert rm.main([]) == 2
    assert "data.train is required" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_two_ranks_equal_one_and_it_learns(runs):
    one, two = (
        logged_steps(runs / "one" / "metrics.jsonl", "rm/loss"),
        logged_steps(runs / "two" / "metrics.jsonl", "rm/loss"),
    )
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("rm/loss", "rm/accuracy", "rm/margin"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)
    evals = logged_steps(runs / "one" / "metrics.jsonl", "eval/rm/loss")
    assert evals[0]["eval/rm/loss"] == pytest.approx(0.693147, abs=1e-5)  # zero head: every score 0, log 2
    assert evals[3]["eval/rm/loss"] < evals[0]["eval/rm/loss"] and evals[3]["eval/rm/accuracy"] > 0.5
    wa = load_file(runs / "one" / "checkpoint-3" / "hf" / "model.safetensors")
    wb = load_file(runs / "two" / "checkpoint-3" / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys() and "score.weight" in wa and "score.bias" not in wa
    for name, t in wa.items():
        assert (t - wb[name]).abs().max().item() < 1e-4, name


@pytest.mark.timeout(900)
def test_the_export_is_a_sequence_classifier_with_the_training_scores(runs, pairs_file):
    """transformers' own forward (one unpadded sequence at a time) reproduces the trainer's final
    held-out metrics, and RewardModel's packed scores equal transformers'."""
    folder = runs / "one" / "checkpoint-3" / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = load_preferences(str(pairs_file))
    items = tokenize_pairs(ChatRenderer(tokenizer), pairs, 2048)
    with torch.no_grad():
        score = lambda ids: float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        chosen = [score(p.chosen.ids) for p in items]
        rejected = [score(p.rejected.ids) for p in items]
    final = logged_steps(runs / "one" / "metrics.jsonl", "eval/rm/loss")[3]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    assert final["eval/rm/margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-6)
    assert final["eval/rm/accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))
    reward_model = RewardModel(str(folder), max_tokens=200)  # several packed rows
    packed = reward_model.score_conversations([p.prompt + p.chosen for p in pairs])
    assert packed == pytest.approx(chosen, abs=1e-5)
    # a right-padded batch with the exported tokenizer's padding: transformers' pooling reads the
    # same tokens (the base model pads with its end-of-turn token, which the export replaces)
    assert tokenizer.pad_token_id == model.config.pad_token_id != tokenizer.eos_token_id
    assert all(p.chosen.ids[-1] == tokenizer.eos_token_id for p in items)  # scored at the end of the turn
    batch = tokenizer.pad({"input_ids": [p.chosen.ids for p in items]}, return_tensors="pt")
    with torch.no_grad():
        padded = model(**batch).logits[:, 0].tolist()
    assert padded == pytest.approx(chosen, abs=1e-5)
    # transformers' chat template renders the same ids up to the last end-of-turn token, then a newline
    text = tokenizer.apply_chat_template(pairs[0].prompt + pairs[0].chosen, tokenize=False)
    templated = tokenizer(text, add_special_tokens=False).input_ids
    last_end = max(i for i, token in enumerate(templated) if token == tokenizer.eos_token_id)
    assert templated[: last_end + 1] == items[0].chosen.ids and tokenizer.decode(templated[last_end + 1 :]) == "\n"
    # a reply cut off before its end-of-turn token is another sequence, with another score
    cut = reward_model.score_ids([p.chosen.ids[:-1] for p in items])
    assert all(abs(a - b) > 1e-6 for a, b in zip(cut, chosen, strict=True))


def test_a_reward_model_that_pads_with_its_end_token_is_scored_as_transformers_pools_it(runs, tmp_path):
    """An export whose padding token is the end-of-turn token (trainers/rm.py's before this
    version, or a model trained with pad = eos) was trained on the token before it: RewardModel
    scores it there, as transformers does, and warns that a cut-off reply then scores alike."""
    folder = tmp_path / "old"
    shutil.copytree(runs / "one" / "checkpoint-3" / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": eos}))
    with pytest.warns(UserWarning, match="pads with an end-of-text token"):
        old = RewardModel(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    sequences = [
        old.renderer.conversation(
            [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
        ).input_ids
    ]
    assert sequences[0][-1] == eos
    with torch.no_grad():
        pooled = float(model(input_ids=torch.tensor(sequences)).logits[0, 0])
    assert old.score_ids(sequences) == pytest.approx([pooled], abs=1e-5)
    assert old.score_ids(sequences) == pytest.approx(old.score_ids([sequences[0][:-1]]), abs=1e-6)


def test_the_exports_padding_is_no_token_generation_stops_on(tiny_dir):
    """Qwen2.5-Instruct pads with ``<|endoftext|>``, which its generation also stops on: the export's
    padding must be neither that nor the end-of-turn token (here SmolLM2's ids: end 2, unknown 0)."""
    config, tokenizer = AutoConfig.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2 and tokenizer.unk_token_id == 0
    saved = scoring_padding(config, tokenizer, GenerationConfig(eos_token_id=[2, 0]))
    assert config.pad_token_id == saved.pad_token_id == tokenizer.bos_token_id == 1
    assert tokenizer.pad_token_id == 2  # the trainer's own tokenizer is left as it was
    config = AutoConfig.from_pretrained(tiny_dir)
    assert scoring_padding(config, tokenizer, GenerationConfig(eos_token_id=2)).pad_token_id == config.pad_token_id == 0


def _episode(renderer, prompt: str, reply: str, env_reward: float) -> Episode:
    sequence = Sequence()
    sequence.extend_context(renderer.prompt_ids([{"role": "user", "content": prompt}]))
    action = renderer.encode(reply) + [renderer.tokenizer.eos_token_id]
    sequence.extend_action(action, [0.0] * len(action), 0)
    sequence.rewards[-1] += env_reward
    return Episode(group=0, sequences=[sequence], turn_rewards=[env_reward], turns=1)


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_reward_model_scores_episodes_in_place(runs, mode):
    reward_model = RewardModel(str(runs / "one" / "checkpoint-3" / "hf"))
    renderer = reward_model.renderer
    episodes = [_episode(renderer, "What is 2 + 3?", "5", 1.0), _episode(renderer, "What is 4 + 4?", "9", 0.0)]
    expected = reward_model.score_ids([e.sequences[0].input_ids for e in episodes])
    metrics = reward_model.apply(RolloutBatch([episodes], {}), mode)
    assert metrics["rollout/rm_score"] == pytest.approx(sum(expected) / 2)
    for episode, score, env_reward in zip(episodes, expected, (1.0, 0.0), strict=True):
        total = score if mode == "replace" else env_reward + score
        assert episode.reward == pytest.approx(total) and episode.info["rm_score"] == score
        rewards = episode.sequences[0].rewards
        assert rewards[-1] == pytest.approx(total) and not any(rewards[:-1])
    with pytest.raises(ValueError, match="reward mode"):
        reward_model.apply(RolloutBatch([episodes], {}), "multiply")


def test_reward_model_scores_in_float32_and_refuses_another_vocabulary(runs):
    """In bfloat16 (CUDA's dtype) the one-label head still computes in float32: the scores are not
    rounded to bfloat16's 8 significant bits, and stay within bfloat16's noise of the float32
    model's. A policy whose tokenizer has another vocabulary is refused (its ids would be scored
    as other tokens)."""
    folder = str(runs / "one" / "checkpoint-3" / "hf")
    exact, half = RewardModel(folder), RewardModel(folder, dtype=torch.bfloat16)
    assert half.model.score.weight.dtype == torch.float32 and half.model.model.norm.weight.dtype == torch.bfloat16
    renderer = exact.renderer
    conversations = [
        [{"role": "user", "content": f"What is {n} + 1?"}, {"role": "assistant", "content": str(n + 1)}]
        for n in range(8)
    ]
    sequences = [renderer.conversation(c).input_ids for c in conversations]
    scores = half.score_ids(sequences)
    assert any(torch.tensor(s).to(torch.bfloat16).item() != s for s in scores)  # off bfloat16's grid
    assert scores == pytest.approx(exact.score_ids(sequences), abs=0.05)
    exact.check_tokenizer(exact.tokenizer)
    other = copy.deepcopy(exact.tokenizer)
    other.add_tokens(["<rl2gem-new-token>"])
    with pytest.raises(ValueError, match="vocabulary differs from the actor's"):
        exact.check_tokenizer(other)


@pytest.mark.timeout(900)
def test_ppo_trains_on_the_reward_model_alone(runs, tiny_dir, tmp_path):
    from test_ppo import arithmetic_run

    out = tmp_path / "ppo"
    torchrun(
        2,
        *arithmetic_run(tiny_dir),
        f"reward.model={runs / 'one'}",  # a run folder: its latest checkpoint
        "reward.mode=replace",
        "rollout.max_new_tokens=8",
        "trainer.total_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    )
    row = logged_steps(out / "metrics.jsonl", "rollout/rm_score")[1]
    assert row["rollout/rm_score"] != 0.0 and "actor/pg_loss" in row
