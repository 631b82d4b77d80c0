"""Mastermind: find a hidden code of digits from black/white peg feedback."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv

from rl2gem.core import StepResult

__all__ = ["MastermindEnv", "score_guess"]

_FEEDBACK = re.compile(r"Guess (\d+): (\d+) black, (\d+) white")


def score_guess(code: str, guess: str) -> tuple[int, int]:
    """(black, white): right digit in the right place, right digit in the wrong place."""
    black = sum(c == g for c, g in zip(code, guess, strict=False))
    common = sum(min(code.count(d), guess.count(d)) for d in set(guess))
    return black, common - black


class MastermindEnv(GameEnv):
    """Find a code of ``code_length`` digits from 1..``num_digits``.

    Each guess ``\\boxed{1234}`` is answered with black pegs (right digit, right
    place) and white pegs (right digit, wrong place). Presets: ``easy`` 3 of 6
    digits in 10 turns, ``medium`` 4 of 6 in 12, ``hard`` 4 of 8 without repeated
    digits in 30 (GEM's hard). ``duplicates`` allows repeated digits in the code.
    """

    PRESETS = {
        "easy": {"code_length": 3, "num_digits": 6, "duplicates": False, "max_turns": 10},
        "medium": {"code_length": 4, "num_digits": 6, "duplicates": True, "max_turns": 12},
        "hard": {"code_length": 4, "num_digits": 8, "duplicates": False, "max_turns": 30},
    }

    def _check_params(self) -> None:
        if not 1 <= self.num_digits <= 9 or self.code_length < 1:
            raise ValueError("num_digits must be 1..9 and code_length >= 1")
        if not self.duplicates and self.code_length > self.num_digits:
            raise ValueError("code_length > num_digits needs duplicates=True")

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        digits = [str(d) for d in range(1, self.num_digits + 1)]
        if self.duplicates:
            self.code = "".join(self.np_random.choice(digits, size=self.code_length))
        else:
            self.code = "".join(self.np_random.choice(digits, size=self.code_length, replace=False))
        rep = "may repeat" if self.duplicates else "are all different"
        return (
            f"Find my secret code: {self.code_length} digits from 1 to {self.num_digits} (the digits {rep}). "
            f"You have {self.max_turns} guesses. After each guess I report black pegs (right digit in the "
            "right place) and white pegs (right digit in the wrong place). Guess like \\boxed{"
            + "".join(digits[: self.code_length])
            + "}."
        ), {}

    def answer(self) -> str:
        return f"The code was {self.code}."

    def move_hint(self) -> str:
        return f"Guess {self.code_length} digits from 1 to {self.num_digits}, like \\boxed{{{'1' * self.code_length}}}."

    def _move(self, move: str) -> StepResult:
        guess = re.sub(r"[\s,]", "", move)
        if len(guess) != self.code_length or any(c not in "123456789"[: self.num_digits] for c in guess):
            return self.malformed(move, "a valid code", "malformed guess")
        black, white = score_guess(self.code, guess)
        if black == self.code_length:
            return self.win(f"Guess {guess}: {black} black, 0 white. You cracked the code!", black=black, white=0)
        return self.reply(f"Guess {guess}: {black} black, {white} white.", black=black, white=white)

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        return "\\boxed{" + "".join(str(d) for d in rng.integers(1, self.num_digits + 1, size=self.code_length)) + "}"

    def make_solver(self):
        """Guesses the first code consistent with all feedback so far (reads the feedback text only)."""
        digits = "123456789"[: self.num_digits]
        pool = (
            itertools.product(digits, repeat=self.code_length)
            if self.duplicates
            else itertools.permutations(digits, self.code_length)
        )
        candidates = ["".join(p) for p in pool]

        def solve(observation: str) -> str:
            m = _FEEDBACK.search(observation)
            if m:
                guess, fb = m.group(1), (int(m.group(2)), int(m.group(3)))
                candidates[:] = [c for c in candidates if score_guess(c, guess) == fb]
            return "\\boxed{" + candidates[0] + "}"

        return solve
