"""The agentic pipeline's accounting of prefix merging (the pipeline itself runs in CI at toy size,
from the README's command)."""

import pytest
from rl2gem.trainers.agentic import PIPELINES, main, prefix_merging_tokens
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
        assert ppo.env == pipe.env and sft.trainer.eval_env == pipe.env
    with pytest.raises(SystemExit):
        main(["no-such-env"])
