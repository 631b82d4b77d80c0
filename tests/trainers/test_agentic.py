"""The agentic pipeline's accounting of prefix merging (the pipeline itself runs in CI at toy size,
from the README's command)."""

import json
from pathlib import Path

import pytest
import torch
from rl2gem.trainers.agentic import PIPELINES, main
from rl2gem.trainers.agentic_report import prefix_merging_tokens, table
from transformers import AutoTokenizer

from rl2gem.evaluation import EpisodeRecord
from rl2gem.models import resolve_model
from rl2gem.rollout.tito import ChatRenderer


def record(messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    return EpisodeRecord(0, 0, None, 0.0, turns, False, True, False, 0, None, 0, messages)


def test_prefix_merging_saves_exactly_the_re_rendered_earlier_turns():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    renderer = ChatRenderer(tokenizer)
    first = [
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "<search>Hamlet</search>"},
    ]
    one = record(first)
    assert prefix_merging_tokens([one], tokenizer) == (len(renderer.conversation(first)),) * 2  # one turn: no saving
    second = [
        *first,
        {"role": "user", "content": "<information>Hamlet is a tragedy by William Shakespeare.</information>"},
        {"role": "assistant", "content": "<answer>William Shakespeare</answer>"},
    ]
    merged, rerendered = prefix_merging_tokens([record(second)], tokenizer)
    assert merged == len(renderer.conversation(second))
    # re-rendering trains the first turn's prompt and action a second time, inside turn 2's prompt
    assert rerendered - merged == len(renderer.prompt_ids(first[:1])) + len(renderer.encode(first[1]["content"])) + 1
    assert prefix_merging_tokens([record(first[:1])], tokenizer) == (0, 0)  # no action: nothing to train


def test_the_pipeline_names_recipes_that_exist_and_refuses_unknown_envs():
    from pathlib import Path

    from rl2gem.config import load_config

    config = Path(__file__).resolve().parents[2] / "trainers" / "config"
    for pipe in PIPELINES.values():
        # every key of each recipe is one its trainer knows (load_config raises ConfigError otherwise)
        sft = load_config(config / "sft.yaml", [f"config={pipe.sft_config}"])
        ppo = load_config(config / "ppo.yaml", [f"config={pipe.ppo_config}"])
        assert ppo.env == pipe.env and sft.trainer.eval_env in (None, pipe.env)
        # sized for the CPU without pinning CUDA's micro-batch length (auto probes there)
        for recipe in (sft, ppo):
            assert recipe.actor.max_length_per_device == "auto" and recipe.actor.cpu_max_length_per_device > 0
    with pytest.raises(SystemExit):
        main(["no-such-env"])
    with pytest.raises(SystemExit, match="--nproc: ranks per node must be auto or an integer >= 1, got '0'"):
        main(["guess", "--nproc", "0"])


def test_sft_from_trains_ppo_from_another_runs_sft_model_and_skips_its_stages(tmp_path, monkeypatch):
    import rl2gem.trainers.agentic as agentic

    shared = tmp_path / "agentic-multihop"
    with pytest.raises(SystemExit, match="no finished SFT stage"):
        main(["multihop-truncate", "--out", str(tmp_path / "run"), "--sft-from", str(shared), "--stages", "ppo"])
    (shared / "sft" / "checkpoint-40").mkdir(parents=True)
    (shared / "sft" / "latest").write_text("checkpoint-40\n")
    (shared / "sft" / "DONE").write_text("done\n")
    commands = []

    def fake_run(cmd, log):  # the stage "ran": it leaves a finished checkpoint as the trainers do
        commands.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("trainer.output_dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "latest").write_text("checkpoint-2\n")

    monkeypatch.setattr(agentic, "_run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    assert main(["multihop-truncate", "--out", str(out), "--sft-from", str(shared), "--stages", "collect,sft,ppo"]) == 0
    assert len(commands) == 1  # only the PPO stage ran
    assert any(a.endswith("ppo.py") for a in commands[0])
    assert "--nproc_per_node=2" in commands[0]  # --nproc auto: the recipes' two ranks (CUDA off above)
    assert f"actor.model={shared / 'sft' / 'checkpoint-40' / 'hf'}" in commands[0]
    assert "config=multihop_truncate" in commands[0]
    assert not (out / "oracle.jsonl").exists() and not (out / "sft").exists()


def _ppo_run(out: Path) -> str:
    return "run " + json.loads((out / "ppo" / "DONE").read_text())["id"]


def test_only_finished_stages_feed_the_next_and_a_changed_input_is_refused(tmp_path, monkeypatch):
    """An SFT stage killed after its first checkpoint is not PPO's start; a PPO stage finished from
    another SFT model (SFT trained again, another --base) is refused, not kept beside the new SFT;
    an evaluation of another model is run again."""
    import rl2gem.trainers.agentic as agentic

    out, commands, crash = tmp_path / "run", [], {"sft": True}

    def fake_run(cmd, log, threads=1):
        commands.append(cmd)
        if "rl2gem.evaluate" in cmd:
            Path(next(a for a in cmd if a.startswith("output=")).split("=", 1)[1]).write_text("{}\n")
            return
        run_dir = Path(next(a for a in cmd if a.startswith("trainer.output_dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = "checkpoint-1" if crash.get(run_dir.name) else "checkpoint-9"
        (run_dir / checkpoint / "hf").mkdir(parents=True, exist_ok=True)
        (run_dir / "latest").write_text(checkpoint + "\n")
        if crash.get(run_dir.name):
            raise SystemExit("stage failed (exit 1)")

    monkeypatch.setattr(agentic, "_run", fake_run)
    out.mkdir()
    (out / "oracle.jsonl").write_text("{}\n")  # collected
    with pytest.raises(SystemExit, match="stage failed"):
        main(["guess", "--out", str(out), "--nproc", "1", "--stages", "sft"])
    with pytest.raises(SystemExit, match="has no finished one"):
        main(["guess", "--out", str(out), "--nproc", "1", "--stages", "ppo"])
    crash["sft"] = False
    assert (
        main(["guess", "--out", str(out), "--nproc", "1", "--stages", "sft,ppo,eval", "--eval-models", "sft+rl"]) == 0
    )
    sft_model = str(out / "sft" / "checkpoint-9" / "hf")
    ppo_command = next(c for c in commands if any(a.endswith("ppo.py") for a in c))
    assert f"actor.model={sft_model}" in ppo_command
    assert (out / "eval" / "sft+rl.model").read_text().strip() == _ppo_run(out)
    # the SFT stage trained again from another base: the PPO stage built on the old one is refused
    (out / "sft" / "DONE").unlink()
    with pytest.raises(
        SystemExit, match=r"ppo was trained from run \w+, but its input is now run \w+ \(.*sft/checkpoint-9/hf\)"
    ):
        main(["guess", "--out", str(out), "--nproc", "1", "--stages", "sft,ppo", "--base", "/models/other"])
    assert "actor.model=/models/other" in commands[-1]  # SFT ran from the new base
    with pytest.raises(SystemExit, match=r"sft was trained from /models/other, but its input is now smollm2"):
        main(["guess", "--out", str(out), "--nproc", "1", "--stages", "eval"])
    # an evaluation of another model is run again; one of this model is kept
    (out / "eval" / "sft+rl.model").write_text("/models/older\n")
    monkeypatch.setattr(agentic, "_finished", lambda run_dir, source: run_dir / "checkpoint-9" / "hf")
    count = len(commands)
    main(["guess", "--out", str(out), "--nproc", "1", "--stages", "eval", "--eval-models", "sft+rl"])
    assert len(commands) == count + 1
    assert (out / "eval" / "sft+rl.model").read_text().strip() == _ppo_run(out)
    main(["guess", "--out", str(out), "--nproc", "1", "--stages", "eval", "--eval-models", "sft+rl"])
    assert len(commands) == count + 1


def test_eval_models_chooses_which_models_the_eval_stage_evaluates(tmp_path, monkeypatch):
    import rl2gem.trainers.agentic as agentic

    out = tmp_path / "run"
    for stage in ("sft", "ppo"):  # finished stages, as the trainers leave them
        (out / stage).mkdir(parents=True)
        (out / stage / "latest").write_text("checkpoint-2\n")
        (out / stage / "DONE").write_text("2026-11-20 10:00:00\n")  # an older run's DONE: no source
    evaluated = []

    def fake_evaluate(pipe, label, model, out, extra):
        evaluated.append((label, model))

    monkeypatch.setattr(agentic, "_evaluate", fake_evaluate)
    assert main(["multihop", "--out", str(out), "--stages", "eval", "--eval-models", "sft,sft+rl"]) == 0
    assert evaluated == [
        ("sft", str(out / "sft" / "checkpoint-2" / "hf")),
        ("sft+rl", str(out / "ppo" / "checkpoint-2" / "hf")),
    ]
    evaluated.clear()
    assert main(["multihop", "--out", str(out), "--stages", "eval"]) == 0  # the default: all three
    assert [label for label, _ in evaluated] == ["base", "sft", "sft+rl"]
    with pytest.raises(SystemExit, match="unknown model 'rl'"):
        main(["multihop", "--out", str(out), "--stages", "eval", "--eval-models", "sft,rl"])


def test_the_table_of_a_run_that_left_out_the_base_model(tmp_path, monkeypatch, drawn_lines):
    """``--eval-models sft,sft+rl``: the table has those two rows and their paired comparison (it
    once read the tokenizer from the base model's entry and raised KeyError)."""
    import dataclasses
    import json

    import rl2gem.trainers.agentic as agentic

    out = tmp_path / "run"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    for stage in ("sft", "ppo"):
        tokenizer.save_pretrained(out / stage / "checkpoint-2" / "hf")  # the table reads the tokenizer only
        (out / stage / "latest").write_text("checkpoint-2\n")
        (out / stage / "DONE").write_text("2026-11-20 10:00:00\n")
    right = {"sft": [1, 1, 0, 0], "sft+rl": [1, 1, 1, 0]}  # one item gained, none lost

    def fake_evaluate(pipe, label, model, out, extra):
        (out / "eval").mkdir(exist_ok=True)
        messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<answer>A</answer>"}]
        lines = []
        for episode, em in enumerate(right[label]):
            info = {"em": float(em), "f1": float(em), "num_searches": 2}
            rec = EpisodeRecord(
                episode, episode, episode, float(em), 1, bool(em), True, False, 0, None, 5, messages, info
            )
            rec.summaries = rec.context_segments = episode % 2  # one summary in every other episode
            lines.append(json.dumps(dataclasses.asdict(rec)))
        (out / "eval" / f"{label}.jsonl").write_text("\n".join(lines) + "\n")

    monkeypatch.setattr(agentic, "_evaluate", fake_evaluate)
    # the PPO curve: step 2 kept no group (no kept reward), step 1 logged again by a resume
    curve = [{"step": 1, "rollout/reward": 0.1}, {"step": 2}, {"step": 3, "rollout/reward": 0.6, "eval/em": 0.75}]
    curve += [{"step": 1, "rollout/reward": 0.5}]
    for row, unfiltered in zip(curve, (0.1, 0.2, 0.3, 0.4), strict=True):
        row["rollout/unfiltered_reward"] = unfiltered
    (out / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in curve))
    with pytest.raises(SystemExit, match="no evaluation"):
        main(["multihop", "--out", str(out), "--stages", "table"])
    assert main(["multihop", "--out", str(out), "--stages", "eval,table", "--eval-models", "sft,sft+rl"]) == 0
    text = (out / "results.md").read_text()
    header, _, *rows = [
        [cell.strip() for cell in line.strip("|").split("|")] for line in text.split("\n\n")[0].splitlines()
    ]
    em, two = header.index("EM"), header.index("2+ searches")
    assert [(row[0], row[em], row[two]) for row in rows] == [("sft", "0.500", "1.000"), ("sft+rl", "0.750", "1.000")]
    assert "Paired, sft -> sft+rl: 1 items gained, 0 lost" in text
    assert (out / "results.png").stat().st_size > 0
    assert drawn_lines == {
        "rollout reward, every group (train questions)": ([1, 2, 3], [0.4, 0.2, 0.3]),
        "rollout reward, kept groups": ([1, 3], [0.5, 0.6]),
        "held-out EM": ([3], [0.75]),
    }
    assert "prefix-merged" in text.splitlines()[0]
    # a context-managed evaluation: the records hold the last segment only, so no merging column
    models = {"sft": str(out / "sft" / "checkpoint-2" / "hf"), "sft+rl": str(out / "ppo" / "checkpoint-2" / "hf")}
    segmented = table(out, models, segmented=True).splitlines()
    assert "prefix-merged" not in segmented[0] and segmented[0].count("|") == segmented[2].count("|")
    header = [cell.strip() for cell in segmented[0].strip("|").split("|")]
    assert [
        segmented[2].strip("|").split("|")[header.index(name)].strip()
        for name in ("summaries / ep", "new segments / ep")
    ] == ["0.50", "0.50"]
