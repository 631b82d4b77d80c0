"""Hangman: find a word one letter at a time before running out of misses."""

from __future__ import annotations

import collections
import functools
import re
import string
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, last_board, word_list

from rl2gem.core import StepResult

__all__ = ["HangmanEnv"]

_STATE = re.compile(r"Word: ([a-z_ ]+)\. Missed: ([a-z, ]*)\.")


class HangmanEnv(GameEnv):
    """Guess the letters of a secret English word (``english-words``, GCIDE and web2).

    A move is one letter ``\\boxed{e}`` or a whole word ``\\boxed{house}``. A
    wrong letter or word is a miss; ``max_misses`` misses lose the game
    (terminated, reward 0). Presets: ``easy`` words of 4-6 letters, 8 misses;
    ``hard`` 6-10 letters, 6 misses. Repeating a letter is an invalid move.
    """

    PRESETS = {
        "easy": {"min_length": 4, "max_length": 6, "max_misses": 8, "max_turns": 40},
        "hard": {"min_length": 6, "max_length": 10, "max_misses": 6, "max_turns": 40},
    }

    def _check_params(self) -> None:
        if not 2 <= self.min_length <= self.max_length:
            raise ValueError("need 2 <= min_length <= max_length")
        if not isinstance(self.max_misses, int) or self.max_misses < 1:
            raise ValueError(f"max_misses must be an int >= 1, got {self.max_misses!r}")
        if not self.words:
            raise ValueError(f"no word of {self.min_length}-{self.max_length} letters in the word list")

    @property
    def words(self) -> tuple[str, ...]:
        return _words(self.min_length, self.max_length)

    def _state(self) -> str:
        shown = " ".join(c if c in self.guessed else "_" for c in self.secret)
        missed = ", ".join(sorted(self.missed))
        return f"Word: {shown}. Missed: {missed}. Misses left: {self.max_misses - len(self.missed)}."

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        words = self.words
        self.secret = words[int(self.np_random.integers(len(words)))]
        self.guessed: set[str] = set()
        self.missed: set[str] = set()
        return (
            f"Let's play Hangman. Guess my secret English word of {len(self.secret)} letters. Each turn guess one "
            f"letter like \\boxed{{e}} or the whole word. {self.max_misses} misses and you lose.\n{self._state()}"
        ), {}

    def answer(self) -> str:
        return f"The word was '{self.secret}'."

    def move_hint(self) -> str:
        return "Guess one letter like \\boxed{e}, or the whole word."

    def _move(self, move: str) -> StepResult:
        guess = move.strip().lower()
        if not guess.isalpha() or not guess.isascii():
            return self.invalid_action(
                "not a letter or word", f"'{move}' is not a letter or a word. {self.move_hint()}"
            )
        if guess in self.missed or (len(guess) == 1 and guess in self.guessed):  # a letter or a word, again
            return self.invalid_action("already guessed", f"You already guessed '{guess}'.\n{self._state()}")
        if len(guess) == 1:
            if guess in self.secret:
                self.guessed.add(guess)
            else:
                self.missed.add(guess)
        elif guess == self.secret:
            self.guessed.update(self.secret)
        else:
            self.missed.add(guess)
        if set(self.secret) <= self.guessed:
            return self.win(f"{self._state()} You found '{self.secret}'!")
        if len(self.missed) >= self.max_misses:
            return self.lose(f"{self._state()} You lost; the word was '{self.secret}'.")
        return self.reply(self._state())

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        tried = set(getattr(self, "guessed", ())) | set(getattr(self, "missed", ()))
        letters = [c for c in string.ascii_lowercase if c not in tried] or list(string.ascii_lowercase)
        return "\\boxed{" + letters[int(rng.integers(len(letters)))] + "}"  # a letter not tried yet

    def make_solver(self):
        """Keeps the words matching the revealed pattern and misses; guesses their most common new letter."""
        words = self.words

        def parse(observation: str) -> tuple[list[str], set[str]] | None:
            m = _STATE.search(observation)
            return (m.group(1).split(" "), {x.strip() for x in m.group(2).split(",") if x.strip()}) if m else None

        board = last_board(parse)

        def solve(observation: str) -> str:
            pattern, missed = board(observation)
            shown = {c for c in pattern if c != "_"}
            tried = shown | missed
            cands = [
                w
                for w in words
                if len(w) == len(pattern)
                and all((p == "_" and c not in shown) or p == c for p, c in zip(pattern, w, strict=False))
                and not (set(w) & missed)
            ]
            if len(cands) == 1:
                return "\\boxed{" + cands[0] + "}"
            freq = collections.Counter(c for w in cands for c in set(w) if c not in tried)
            letter = (
                max(sorted(freq), key=freq.get) if freq else next(c for c in string.ascii_lowercase if c not in tried)
            )
            return "\\boxed{" + letter + "}"

        return solve


@functools.cache
def _words(min_length: int, max_length: int) -> tuple[str, ...]:
    return tuple(w for w in word_list(None, common=True) if min_length <= len(w) <= max_length)
