"""A tiny Llama built from config with the real SmolLM2 tokenizer, for fast engine tests."""

from __future__ import annotations

import pytest
from tiny import tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_model().save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def model():
    return tiny_model()
