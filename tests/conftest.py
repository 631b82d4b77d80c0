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


@pytest.fixture
def drawn_lines(monkeypatch):
    """What matplotlib's ``Axes.plot`` draws during the test: label -> (x values, y values); the
    lines are still drawn."""
    import matplotlib.axes

    drawn = {}
    original = matplotlib.axes.Axes.plot

    def plot(self, *args, label=None, **kwargs):
        drawn[label] = (list(args[0]), list(args[1]))
        return original(self, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    return drawn


#: Tests that start training runs or README commands: tens of seconds each, a few over a minute.
HEAVY = (
    "tests/test_examples.py::test_readme",
    "tests/trainers/",
    "tests/envs/test_math_env.py::test_builtin_sources",
    "tests/test_gpu.py::test_each_trainer",  # pytest -m gpu: cut at its stage's limit, the trainers first
)


def _heavy(item) -> bool:
    return item.nodeid.startswith(HEAVY) or "tiny_dir" in item.fixturenames


def pytest_collection_modifyitems(items):
    """The heavy tests first (a stable sort): pytest-xdist's work stealing then hands the light
    ones out last, so that the CPU suite's two workers finish together rather than one waiting on
    the other's last minute-long run. ``pytest -m gpu`` runs with many workers and ``--dist load``
    (``benchmarks/gpu_session.sh``), which deals each worker two consecutive tests first: its
    trainer runs alternate with light tests, so each starts at once on a worker of its own."""
    items.sort(key=lambda item: not _heavy(item))
    gpu = [index for index, item in enumerate(items) if item.nodeid.startswith("tests/test_gpu.py")]
    heavy = [items[index] for index in gpu if _heavy(items[index])]
    light = [items[index] for index in gpu if not _heavy(items[index])]
    alternated = [item for pair in zip(heavy, light, strict=False) for item in pair]
    alternated += heavy[len(light) :] + light[len(heavy) :]
    for index, item in zip(gpu, alternated, strict=True):
        items[index] = item
