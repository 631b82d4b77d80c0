"""Procedural reasoning tasks from ``reasoning-gym``, scored with its own ``score_answer``.

``task=`` is any name in ``reasoning_gym.factory.DATASETS`` (104 in 0.1.23:
``countdown``, ``basic_arithmetic``, ``gsm_symbolic``, ``letter_counting``, ...).
Items are generated on demand from the index, so a split of 100,000 items
costs nothing until an item is drawn. ``split="train"`` and ``"test"`` draw
from differently seeded generators (``seed=1`` and ``seed=2``); for tasks with
small item spaces the two can share items.

The agent answers inside ``<answer>...</answer>`` (reasoning-gym's own
extraction). Reward mapping: reasoning-gym gives wrong answers small partial
credit (0.01 for none, about 0.05 for a wrong one, task-dependent), which
would reward any output. With ``reward="binary"`` (default) the reward is 1.0
when the raw score is 1.0 and 0.0 otherwise; with ``reward="raw"`` it is the
raw score. ``info["raw_score"]`` always holds the raw score. A response without
the answer tags, or with nothing in them but spaces or punctuation, scores 0
(``info["format_ok"] = False``).

A task with its own scorer scores the answer in the Python sandbox (:func:`rl2gem.tools.run_python`,
:data:`SCORING`; reasoning-gym's default scorer, a string comparison, runs in process):
several reasoning-gym scorers evaluate the answer as Python (countdown and puzzle24 through
sympy's ``parse_expr``, n_queens and spiral_matrix through ``eval``), so an answer such as
``[__import__('os').system(...), 1+2].pop()`` ran in the trainer's process, and one that patched
``numpy.isclose`` made every later answer score 1.0. Each scoring is a fresh child of a warm fork
server (about 30 ms; the first in a process starts the server, about 2 s), with the sandbox's
limits: a scorer past :data:`SCORING`'s ``timeout_s`` (``9**9**9**9``) scores 0.

A task whose generator executes code from its data (``codeio``: reasoning-gym ``exec``s an
LLM-rewritten snippet to make each item's input/output pair) also makes its items in the sandbox
(:data:`GENERATION`, about 0.2 s an item): on the host, some of those snippets wrote files into
the working folder (``sailor_performance.csv`` at train index 447) and printed their errors to
stdout. The item comes back as JSON, so tuples in its metadata come back as lists.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import inspect
import json
import pickle
import re
import secrets
import string
from typing import Any

from rl2gem.core import Env, StepResult
from rl2gem.tools import SandboxConfig, run_python

__all__ = ["ReasoningGymEnv", "task_names"]

SPLIT_SEEDS = {"train": 1, "test": 2}
FORMAT = "Think step by step, then give only the final answer inside <answer></answer>."
PLAIN_FORMAT = "Answer with just the final answer, nothing else."
NUMBER_FORMAT = "Answer with just the number."
ANSWER_MODES = ("tag", "plain", "last_number")
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])\d+(?:\.\d+)?")  # a minus sign, not a hyphen after a word or digit

#: Answers that script Python rather than state a result: a dunder, or a call of a builtin that
#: runs code or reaches objects, refused for the tasks whose module evaluates Python
#: (:func:`_evaluates_python`: countdown, puzzle24, n_queens...; no answer of theirs is either).
#: The sandbox keeps such an answer off the host and away from other episodes; refusing it keeps it
#: from rewriting its own scorer (``setattr(numpy, "isclose", ...)`` before the comparison).
_SCRIPTED = re.compile(
    r"__|\b(?:exec|eval|compile|open|getattr|setattr|delattr|globals|locals|vars|breakpoint|input)\s*\("
)

#: Where answers are scored: the sandbox, reasoning-gym imported once by its fork server.
SCORING = SandboxConfig(timeout_s=10.0, memory_mb=2048, preload=("reasoning_gym",), max_output_chars=2000)

#: Where the items of a task whose generator executes code (:func:`_generation_runs_code`) are made.
GENERATION = SandboxConfig(timeout_s=30.0, memory_mb=2048, preload=("reasoning_gym",), max_output_chars=1_000_000)

# Run in the sandbox: the task (pickled by this process) in, the item out as JSON on the line
# that starts with this call's random tag
_ITEM_CODE = """
import base64, contextlib, io, json, pickle, reasoning_gym
task, seed, size, config, index = pickle.loads(base64.b64decode({blob!r}))
with contextlib.redirect_stdout(io.StringIO()):  # what the snippets print (without a newline, some)
    item = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)[index]
print({tag!r}, json.dumps(item))
"""

# Run in the sandbox: the item (pickled by this process) and the answer (a literal) in, the score
# out on a line that starts with this call's random tag (an answer that prints a score of its own,
# then exits, prints no such line)
_SCORE_CODE = """
import base64, json, pickle, reasoning_gym
task, seed, config, item = pickle.loads(base64.b64decode({blob!r}))
dataset = reasoning_gym.create_dataset(task, size=1, seed=seed, **config)
score = float(dataset.score_answer({answer!r}, item))
print({tag!r}, json.dumps(score))
"""


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators removed), or None.

    The lenient extraction of GSM8K-style evaluations (lm-evaluation-harness's
    "flexible-extract"): ``"34 + 17 = 51."`` gives ``"51"``.
    """
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def task_names() -> list[str]:
    """The task names reasoning-gym offers."""
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


@functools.cache
def _evaluates_python(task: str) -> bool:
    """Whether the module of ``task``'s dataset calls ``eval`` or sympy's ``parse_expr`` (its
    scorer may evaluate an answer as Python)."""
    source = inspect.getsource(inspect.getmodule(_task_class(task)))
    return "parse_expr" in source or re.search(r"\beval\(", source) is not None


@functools.cache
def _generation_runs_code(task: str) -> bool:
    """Whether the module of ``task``'s dataset calls ``exec`` (codeio: its items come from
    running snippets of its data)."""
    source = inspect.getsource(inspect.getmodule(_task_class(task)))
    return re.search(r"\bexec\(", source) is not None


@functools.cache
def _default_scorer(task: str) -> bool:
    """Whether ``task`` scores with reasoning-gym's base ``score_answer`` (string comparison, no
    code run), not a scorer of its own."""
    from reasoning_gym.dataset import ProceduralDataset

    return _task_class(task).score_answer is ProceduralDataset.score_answer


def _task_class(task: str) -> type:
    """The dataset class of ``task``."""
    import reasoning_gym

    return reasoning_gym.factory.DATASETS[task][0]


def _check_task_options(task: str, options: dict[str, Any]) -> None:
    """Refuse what reasoning-gym would refuse at the first reset: an option the task's config has
    no field for, or values its ``validate()`` rejects."""
    import reasoning_gym

    config_class = reasoning_gym.factory.DATASETS[task][1]
    fields = {field.name for field in dataclasses.fields(config_class)} - {"seed", "size"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"reasoning-gym task {task!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    validate = getattr(config_class(**options) if options else None, "validate", None)  # not every task has one
    try:
        if validate is not None:
            validate()
    except (AssertionError, ValueError, TypeError) as e:  # reasoning-gym validates with asserts
        raise ValueError(f"reasoning-gym task {task!r} refused {options}: {e or type(e).__name__}") from None


@functools.lru_cache(maxsize=64)
def _dataset(task: str, split: str, size: int, config_items: tuple):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=SPLIT_SEEDS[split], **dict(config_items))


class ReasoningGymEnv(Env):
    """Single-turn reasoning-gym task.

    Args:
        task: a reasoning-gym dataset name.
        split: ``"train"`` or ``"test"``.
        size: items per split (generated lazily).
        reward: ``"binary"`` or ``"raw"`` (see the module doc).
        instructions: the text after the question (default: :data:`FORMAT` or :data:`PLAIN_FORMAT`).
        answer: ``"tag"`` scores what is inside ``<answer></answer>`` (missing tags: invalid
            action); ``"plain"`` scores the whole stripped reply ("answer with just the number");
            ``"last_number"`` scores the last number in the reply (:func:`last_number`; no number:
            invalid action), for numeric tasks and small models that answer ``"a + b = c"``.
        **config: passed to ``reasoning_gym.create_dataset`` (task options such as ``min_numbers``).

    Raises:
        ValueError: unknown task, split or reward mode.
    """

    invalid_action_terminates = True

    def __init__(
        self,
        task: str = "basic_arithmetic",
        split: str = "train",
        *,
        size: int = 100_000,
        reward: str = "binary",
        instructions: str | None = None,
        answer: str = "tag",
        render_mode: str | None = None,
        **config: Any,
    ):
        super().__init__(max_turns=1, render_mode=render_mode)
        if answer not in ANSWER_MODES:
            raise ValueError(f"answer must be one of {ANSWER_MODES}, got {answer!r}")
        self.answer_mode = answer
        default = {"tag": FORMAT, "plain": PLAIN_FORMAT, "last_number": NUMBER_FORMAT}[answer]
        self.instructions = str(instructions) if instructions is not None else default
        if task not in task_names():
            import difflib

            close = difflib.get_close_matches(task, task_names(), n=3)
            raise ValueError(f"unknown reasoning-gym task {task!r}" + (f"; did you mean {close}?" if close else ""))
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
        if reward not in ("binary", "raw"):
            raise ValueError(f"reward must be 'binary' or 'raw', got {reward!r}")
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        _check_task_options(task, config)
        self.task, self.split, self.size, self.reward_mode = task, split, int(size), reward
        self.config = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in config.items()))
        self.item: dict[str, Any] | None = None

    @property
    def dataset(self):
        return _dataset(self.task, self.split, self.size, self.config)

    async def _areset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        index = self.task_index(self.size, options)
        if _generation_runs_code(self.task):
            self.item = await self._generate_in_sandbox(index)
        else:  # generating an item can take 0.1-0.5 s (zebra_puzzles, futoshiki): not on the event loop
            self.item = await asyncio.to_thread(lambda: self.dataset[index])
        return f"{self.item['question']}\n\n{self.instructions}", {
            "index": index,
            "task": self.task,
            "split": self.split,
        }

    async def _generate_in_sandbox(self, index: int) -> dict[str, Any]:
        """Item ``index`` of this split, made by reasoning-gym in the sandbox (:data:`GENERATION`).

        Raises:
            RuntimeError: the generator timed out or printed no item (the sandbox's last error line).
        """
        task = (self.task, SPLIT_SEEDS[self.split], self.size, dict(self.config), index)
        blob, tag = base64.b64encode(pickle.dumps(task)).decode(), secrets.token_hex(16)
        result = await run_python(_ITEM_CODE.format(blob=blob, tag=tag), GENERATION)
        items = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith(tag + " ")]
        if result.exit_code == 0 and not result.timed_out and len(items) == 1:
            return json.loads(items[0])
        why = "timed out" if result.timed_out else (result.stderr.strip().splitlines()[-1:] or ["no item"])[0]
        raise RuntimeError(f"reasoning-gym {self.task!r} item {index} could not be made in the sandbox: {why[:200]}")

    async def _score(self, answer: str) -> tuple[float, str | None]:
        """``(raw score, None)`` of ``answer`` by the task's scorer, or ``(0.0, why)`` when the
        scorer failed, ran out of time or printed no score. reasoning-gym's default scorer (an exact
        or contained string match: basic_arithmetic, gsm_symbolic...) runs here; a task's own
        scorer runs in the sandbox."""
        if _default_scorer(self.task):
            return float(self.dataset.score_answer(answer, self.item)), None
        if _SCRIPTED.search(answer) and _evaluates_python(self.task):
            return 0.0, "the answer is Python code"
        task = (self.task, SPLIT_SEEDS[self.split], dict(self.config), self.item)
        blob, tag = base64.b64encode(pickle.dumps(task)).decode(), secrets.token_hex(16)
        result = await run_python(_SCORE_CODE.format(blob=blob, answer=answer, tag=tag), SCORING)
        if result.timed_out:
            return 0.0, "timed out"
        scores = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith(tag + " ")]
        if result.exit_code == 0 and len(scores) == 1:
            return float(json.loads(scores[0])), None
        error = result.stderr.strip().splitlines()[-1:] or [f"no score (exit {result.exit_code})"]
        return 0.0, error[0][:200]

    async def _astep(self, action: str) -> StepResult:
        from reasoning_gym.utils import extract_answer

        assert self.item is not None
        if self.answer_mode == "tag":
            answer, missing = extract_answer(action, tag_name="answer"), "missing <answer></answer>"
        elif self.answer_mode == "last_number":
            answer, missing = last_number(action), "no number in the reply"
        else:
            answer, missing = action.strip(), ""
        if answer is not None and not answer.strip(string.whitespace + string.punctuation):
            answer = None  # <answer></answer>, <answer> . </answer>: no answer, and no format credit
        if answer is None:
            return self.invalid_action(
                missing,
                "",
                terminated=True,
                format_ok=False,
                raw_score=0.0,
                reference=self.item["answer"],
                reward_components={"correctness": 0.0, "format": 0.0},
            )
        raw, error = await self._score(answer)
        if error is not None:
            answer = f"{answer} (scorer error: {error})"
        reward = raw if self.reward_mode == "raw" else float(raw >= 1.0)
        info = {
            "answer": answer,
            "raw_score": raw,
            "reference": self.item["answer"],
            "format_ok": True,
            "success": raw >= 1.0,
            "reward_components": {"correctness": float(raw >= 1.0), "format": 1.0},
        }
        return "", reward, True, False, info

    def unscored_info(self) -> dict[str, Any]:
        """The scores of an action refused before it was read (empty, too long): ``raw_score``
        0 (always present, as the module doc says), no format."""
        assert self.item is not None
        return {
            "raw_score": 0.0,
            "format_ok": False,
            "reference": self.item["answer"],
            "success": False,
            "reward_components": {"correctness": 0.0, "format": 0.0},
        }

    def sample_random_action(self, rng=None) -> str:
        rng = self.action_rng(rng)
        return self._format(int(rng.integers(0, 100)))

    def _format(self, answer) -> str:
        return f"<answer>{answer}</answer>" if self.answer_mode == "tag" else str(answer)

    def make_solver(self):
        """An oracle answering the generator's reference (checks data and scorer)."""
        env = self
        return lambda obs: env._format(env.item["answer"])
