import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A folder with the tiny random Llama and SmolLM2's tokenizer, loadable as ``actor.model``."""
    from tiny import tiny_model
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")).save_pretrained(folder)
    return folder
