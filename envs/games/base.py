"""Shared parts of the text games: difficulty presets, the ``\\boxed{}`` move format, word lists."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from rl2gem.assets import asset_path
from rl2gem.core import Env, StepResult
from rl2gem.rewards import extract_boxed

__all__ = ["GameEnv", "last_board", "word_list"]

Board = TypeVar("Board")


class GameEnv(Env):
    """A multi-turn game whose moves are written as ``\\boxed{move}`` (the last box counts).

    Subclasses set :attr:`PRESETS` (difficulty name -> constructor defaults,
    including ``max_turns``) and implement ``_reset`` and ``_move(move: str)``.
    Any preset value can be overridden by a keyword argument.

    Reward: 1.0 on the winning move, 0.0 otherwise (no shaping). The turn limit is part of the
    game: a last allowed move that does not win loses it (``terminated``, ``success`` False, the
    answer shown: :meth:`answer`), as a game's own losses do, rather than truncating the episode.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    DEFAULT_DIFFICULTY: ClassVar[str] = "hard"

    def __init__(self, difficulty: str | None = None, *, render_mode: str | None = None, **overrides: Any):
        difficulty = difficulty or self.DEFAULT_DIFFICULTY
        if difficulty not in self.PRESETS:
            raise ValueError(f"difficulty must be one of {sorted(self.PRESETS)}, got {difficulty!r}")
        params = {**self.PRESETS[difficulty]}
        unknown = set(overrides) - set(params)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown argument(s) {sorted(unknown)}; valid: {sorted(params)}")
        if "max_turns" in overrides and overrides["max_turns"] is None:  # None is "no limit" elsewhere
            raise ValueError(
                f"max_turns=None: a game's turn limit is part of it (the {difficulty} preset's is "
                f"{params['max_turns']}); pass a number"
            )
        params.update({k: v for k, v in overrides.items() if v is not None})
        super().__init__(max_turns=params.pop("max_turns"), render_mode=render_mode)
        self.difficulty = difficulty
        for k, v in params.items():
            setattr(self, k, v)
        self._check_params()

    def _check_params(self) -> None:
        """Validate the parameters (raise ValueError)."""

    def _step(self, action: str) -> StepResult:
        move = extract_boxed(action)
        if move is None:
            result = self.invalid_action("no \\boxed{} move", f"I could not find a move. {self.move_hint()}")
        else:
            result = self._move(move.strip())
        observation, reward, terminated, truncated, info = result
        if not (terminated or truncated) and self.max_turns is not None and self.turn + 1 >= self.max_turns:
            told = f" {self.answer()}" if self.answer() else ""
            return self.lose(f"{observation}\nNo moves left: you lost.{told}", **info)
        return result

    def answer(self) -> str:
        """What a lost game shows of its answer (``The word was ...``); empty for games without one."""
        return ""

    def _move(self, move: str) -> StepResult:
        raise NotImplementedError

    def move_hint(self) -> str:
        """One sentence telling the format of a move."""
        return "Write your move as \\boxed{...}."

    def malformed(self, move: str, what: str = "a move", reason: str = "malformed move") -> StepResult:
        """The invalid-move result for a move the game cannot parse, with the format hint."""
        return self.invalid_action(reason, f"'{move}' is not {what}. {self.move_hint()}")

    def win(self, observation: str, **info: Any) -> StepResult:
        return observation, 1.0, True, False, {**info, "success": True}

    def reply(self, observation: str, **info: Any) -> StepResult:
        return observation, 0.0, False, False, {**info, "success": False}

    def lose(self, observation: str, **info: Any) -> StepResult:
        return observation, 0.0, True, False, {**info, "success": False}


@functools.cache
def word_list(length: int | None = None, common: bool = True) -> tuple[str, ...]:
    """Lower-case a-z English words from the ``english-words`` package (2.0.2).

    Args:
        length: keep only words of this length.
        common: words in both GCIDE and web2 (5,041 five-letter words) rather
            than web2 alone (a larger list with many rare words).
    """

    def load(name: str) -> set[str]:
        with open(asset_path("english-words", "english_words", "data", f"{name}_alpha_lower.pickle"), "rb") as fh:
            return pickle.load(fh)

    words = load("web2")
    if common:
        words = words & load("gcide")
    return tuple(sorted(w for w in words if w.isascii() and w.isalpha() and (length is None or len(w) == length)))


def last_board(parse: Callable[[str], Board | None]) -> Callable[[str], Board]:
    """A solver's board reader that remembers: ``parse(observation)`` where it finds a board
    (None where it does not), else the last board it read. An invalid move's correction ("'x' is
    not a move ...") carries no board; the position is then the one before that move.

    Raises:
        ValueError: no observation so far had a board.
    """
    seen: list[Board] = []

    def read(observation: str) -> Board:
        board = parse(observation)
        if board is not None:
            seen[:] = [board]
        elif not seen:
            raise ValueError(
                f"the solver found no board in this observation, nor in an earlier one: {observation[:200]!r}"
            )
        return seen[0]

    return read
