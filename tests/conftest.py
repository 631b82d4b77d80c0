import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs one pytest worker per core (pytest-xdist): one OpenMP thread each, inherited
    # by the subprocesses a test starts, so the workers do not oversubscribe the cores (libgomp
    # then sleeps between parallel regions instead of spinning, rl2gem/openmp.py)
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")

#: Tests of a minute or more in CI (the README's commands, the GSM8K variants' generation), run
#: first: the workers of ``make test`` then end on short tests instead of one worker finishing a
#: long one alone (pytest-xdist's work stealing moves the short ones).
LONG_TESTS = (
    "tests/test_examples.py::test_readme_shell_commands_run",
    "tests/test_examples.py::test_readme_python_blocks_run",
    "tests/envs/test_math_env.py::test_builtin_sources_have_the_expected_items[gsm8k-train",
    "tests/trainers/test_ppo.py::test_resume_after_kill_9",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_TESTS))  # stable: the rest keep their order


@pytest.fixture(scope="session")  # one per test process: pytest-xdist interleaves modules
def tiny_dir(tmp_path_factory):
    """A folder with the tiny random Llama and SmolLM2's tokenizer, loadable as ``actor.model``."""
    from tiny import tiny_model
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")).save_pretrained(folder)
    return folder
