"""Wordle: find a five-letter English word from green/yellow/gray letter feedback."""

from __future__ import annotations

import collections
import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, word_list

from rl2gem.core import StepResult

__all__ = ["WordleEnv", "feedback"]

_LINE = re.compile(r"([a-z]+) -> ([GYX]+)")


def feedback(secret: str, guess: str) -> str:
    """Per letter: ``G`` right place, ``Y`` in the word elsewhere, ``X`` not (more). Repeated letters
    are matched greens first, then yellows left to right, as in the original game."""
    marks = ["X"] * len(guess)
    left = collections.Counter(s for s, g in zip(secret, guess, strict=False) if s != g)
    for i, (s, g) in enumerate(zip(secret, guess, strict=False)):
        if s == g:
            marks[i] = "G"
        elif left[g] > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


class WordleEnv(GameEnv):
    """Find a secret word of ``word_length`` letters.

    Secrets come from the common English words of the ``english-words`` package
    (in both GCIDE and web2: 5,041 five-letter words); guesses must be words of
    web2 (a larger list). Each guess ``\\boxed{crane}`` is answered with one mark
    per letter: G (right place), Y (elsewhere in the word), X (absent). Presets:
    ``easy`` 5 letters in 10 turns, ``hard`` 5 letters in 6 turns (the original).
    """

    PRESETS = {
        "easy": {"word_length": 5, "max_turns": 10},
        "hard": {"word_length": 5, "max_turns": 6},
    }

    def _check_params(self) -> None:
        if not 3 <= self.word_length <= 8:
            raise ValueError("word_length must be 3..8")

    @property
    def secrets(self) -> tuple[str, ...]:
        return word_list(self.word_length, common=True)

    @property
    def allowed(self) -> frozenset[str]:
        return _allowed(self.word_length)

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self.secret = self.secrets[int(self.np_random.integers(len(self.secrets)))]
        return (
            f"Let's play Wordle. Find my secret {self.word_length}-letter English word in {self.max_turns} guesses. "
            "After each guess I mark every letter: G = right letter, right place; Y = in the word, other place; "
            "X = not in the word. Guess one word per turn, like \\boxed{" + self.secrets[0] + "}."
        ), {}

    def answer(self) -> str:
        return f"The word was '{self.secret}'."

    def move_hint(self) -> str:
        return f"Guess one {self.word_length}-letter English word, like \\boxed{{{self.secrets[0]}}}."

    def _move(self, move: str) -> StepResult:
        guess = move.strip().lower()
        if len(guess) != self.word_length or not guess.isalpha():
            return self.invalid_action(
                "not a word of the right length", f"'{move}' is not a {self.word_length}-letter word."
            )
        if guess not in self.allowed:
            return self.invalid_action("unknown word", f"'{guess}' is not in my word list. Try another word.")
        marks = feedback(self.secret, guess)
        if guess == self.secret:
            return self.win(f"{guess} -> {marks}. You found the word!", marks=marks)
        return self.reply(f"{guess} -> {marks}", marks=marks)

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        return "\\boxed{" + self.secrets[int(rng.integers(len(self.secrets)))] + "}"

    def make_solver(self):
        """Keeps the secrets consistent with every mark so far; guesses the one whose
        letters are most frequent among them (reads the feedback text only)."""
        candidates = list(self.secrets)

        def solve(observation: str) -> str:
            m = _LINE.search(observation)
            if m:
                guess, marks = m.group(1), m.group(2)
                candidates[:] = [w for w in candidates if feedback(w, guess) == marks]
            freq = collections.Counter(c for w in candidates for c in set(w))
            best = max(candidates, key=lambda w: sum(freq[c] for c in set(w)))
            return "\\boxed{" + best + "}"

        return solve


def _allowed(length: int) -> frozenset[str]:
    return frozenset(word_list(length, common=False))
