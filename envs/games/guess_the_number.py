"""Guess the number: find a hidden integer from higher/lower feedback."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv

from rl2gem.core import StepResult

__all__ = ["GuessTheNumberEnv", "BisectSolver"]

_FEEDBACK = re.compile(r"(higher|lower) than (-?\d+)")


class GuessTheNumberEnv(GameEnv):
    """Guess a hidden integer in ``[min_number, max_number]``; wrong guesses get "higher"/"lower".

    Presets (``difficulty=``): ``easy`` 1..10 in 4 turns, ``medium`` 1..20 in 5,
    ``hard`` 1..50 in 7 (GEM's hard), ``expert`` 1..1000 in 12. Bisection needs
    ceil(log2(n + 1)) guesses for n numbers, so every preset is winnable (fewer turns, as a
    ``max_turns=`` may set, leave it to luck). Out-of-range or
    non-integer guesses are invalid moves (reward 0, the episode goes on).
    """

    PRESETS = {
        "easy": {"min_number": 1, "max_number": 10, "max_turns": 4},
        "medium": {"min_number": 1, "max_number": 20, "max_turns": 5},
        "hard": {"min_number": 1, "max_number": 50, "max_turns": 7},
        "expert": {"min_number": 1, "max_number": 1000, "max_turns": 12},
    }

    def _check_params(self) -> None:
        if self.min_number >= self.max_number:
            raise ValueError(f"min_number must be < max_number, got {self.min_number} >= {self.max_number}")

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self.target = int(self.np_random.integers(self.min_number, self.max_number + 1))
        return (
            f"I am thinking of a whole number between {self.min_number} and {self.max_number} (inclusive). "
            f"Find it in at most {self.max_turns} guesses. After each guess I will tell you whether "
            "the number is higher or lower. Give one guess per turn as \\boxed{N}."
        ), {}

    def answer(self) -> str:
        return f"The number was {self.target}."

    def move_hint(self) -> str:
        return "Answer with \\boxed{N}."

    def _move(self, move: str) -> StepResult:
        try:
            guess = int(move)
        except ValueError:
            return self.invalid_action("guess is not an integer", f"'{move}' is not a whole number.")
        if not self.min_number <= guess <= self.max_number:
            return self.invalid_action(
                "guess out of range", f"{guess} is outside {self.min_number}..{self.max_number}. Guess again."
            )
        if guess == self.target:
            return self.win(f"Correct, the number is {guess}.", guess=guess)
        direction = "higher" if self.target > guess else "lower"
        return self.reply(f"The number is {direction} than {guess}.", guess=guess)

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        return f"\\boxed{{{int(rng.integers(self.min_number, self.max_number + 1))}}}"

    def make_solver(self) -> BisectSolver:
        """Bisects on the feedback text (it does not peek at the target)."""
        return BisectSolver(self.min_number, self.max_number)

    def render_text(self) -> str:
        return f"GuessTheNumber [{self.min_number}, {self.max_number}] turn {self.turn}/{self.max_turns}"


class BisectSolver:
    """Reads "higher/lower than N" feedback and guesses the middle of what remains."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def __call__(self, observation: str) -> str:
        m = _FEEDBACK.search(observation)
        if m:
            n = int(m.group(2))
            if m.group(1) == "higher":
                self.lo = max(self.lo, n + 1)
            else:
                self.hi = min(self.hi, n - 1)
        return f"\\boxed{{{(self.lo + self.hi) // 2}}}"
