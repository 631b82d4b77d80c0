"""Sliding puzzle (the 8- and 15-puzzle): slide tiles into the blank until the board is in order."""

from __future__ import annotations

import heapq
import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, last_board

from rl2gem.core import StepResult

__all__ = ["FifteenPuzzleEnv", "solve_puzzle"]


def _goal(n: int) -> tuple[int, ...]:
    return tuple(list(range(1, n * n)) + [0])


def _slides(state: tuple[int, ...], n: int):
    """(tile, next state) for every tile next to the blank."""
    z = state.index(0)
    r, c = divmod(z, n)
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        rr, cc = r + dr, c + dc
        if 0 <= rr < n and 0 <= cc < n:
            j = rr * n + cc
            s = list(state)
            s[z], s[j] = s[j], 0
            yield state[j], tuple(s)


def solve_puzzle(state: tuple[int, ...], n: int) -> list[int]:
    """Tiles to slide, in order, for a shortest solution (A* with the Manhattan distance)."""
    goal = _goal(n)

    def h(s):
        return sum(abs(i // n - (t - 1) // n) + abs(i % n - (t - 1) % n) for i, t in enumerate(s) if t)

    frontier = [(h(state), 0, state, ())]
    seen = {state: 0}
    while frontier:
        _, g, s, path = heapq.heappop(frontier)
        if s == goal:
            return list(path)
        for tile, nxt in _slides(s, n):
            if seen.get(nxt, 1 << 30) > g + 1:
                seen[nxt] = g + 1
                heapq.heappush(frontier, (g + 1 + h(nxt), g + 1, nxt, path + (tile,)))
    raise ValueError("unsolvable position")


class FifteenPuzzleEnv(GameEnv):
    """Order the tiles of a ``size`` x ``size`` sliding puzzle (blank last).

    A move ``\\boxed{7}`` slides tile 7 into the blank (it must be next to it).
    The start is the solved board scrambled by ``scramble`` random slides (never
    undoing the previous one), so it is always solvable within that many moves.
    Presets: ``easy`` 3x3 scrambled 8 slides / 20 turns, ``medium`` 3x3, 16 / 40,
    ``hard`` 4x4, 20 / 60.
    """

    PRESETS = {
        "easy": {"size": 3, "scramble": 8, "max_turns": 20},
        "medium": {"size": 3, "scramble": 16, "max_turns": 40},
        "hard": {"size": 4, "scramble": 20, "max_turns": 60},
    }

    def _check_params(self) -> None:
        if not 3 <= self.size <= 5 or self.scramble < 1:  # 2x2: a scramble walks one 12-board cycle (it hung)
            raise ValueError("size must be 3..5 and scramble >= 1")

    def board_text(self) -> str:
        w = len(str(self.size**2 - 1))
        rows = [self.state[r * self.size : (r + 1) * self.size] for r in range(self.size)]
        return "\n".join(" ".join(f"{t:>{w}}" if t else "_" * w for t in row) for row in rows)

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        n = self.size
        state, prev = _goal(n), None
        while state == _goal(n):
            for _ in range(self.scramble):
                moves = [(t, s) for t, s in _slides(state, n) if s != prev]
                prev = state
                state = moves[int(self.np_random.integers(len(moves)))][1]
        self.state = state
        return (
            f"Sliding puzzle: put the tiles in order 1..{n * n - 1} row by row with the blank (_) last. Each turn "
            f"slide one tile next to the blank into it, written like \\boxed{{5}}. You have {self.max_turns} moves.\n"
            f"{self.board_text()}"
        ), {}

    def move_hint(self) -> str:
        return "Write the number of a tile next to the blank, like \\boxed{5}."

    def _move(self, move: str) -> StepResult:
        if not re.fullmatch(r"\d+", move.strip()):
            return self.malformed(move, "a tile number")
        tile = int(move)
        for t, nxt in _slides(self.state, self.size):
            if t == tile:
                self.state = nxt
                if nxt == _goal(self.size):
                    return self.win(f"Solved!\n{self.board_text()}")
                return self.reply(self.board_text())
        return self.invalid_action(
            "tile not next to the blank", f"Tile {tile} is not next to the blank.\n{self.board_text()}"
        )

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        if getattr(self, "state", None) is None:  # before a reset: any tile
            return f"\\boxed{{{int(rng.integers(1, self.size**2))}}}"
        tiles = [tile for tile, _ in _slides(self.state, self.size)]  # a legal slide: a tile next to the blank
        return f"\\boxed{{{tiles[int(rng.integers(len(tiles)))]}}}"

    def make_solver(self):
        """Parses the board, finds a shortest solution with A*, slides its first tile."""
        n = self.size

        def parse(observation: str) -> tuple[int, ...] | None:
            rows = [ln.split() for ln in observation.splitlines() if re.fullmatch(r"[\d_]+( +[\d_]+)*", ln.strip())]
            rows = [r for r in rows if len(r) == n][-n:]
            return tuple(0 if x.startswith("_") else int(x) for row in rows for x in row) if len(rows) == n else None

        board = last_board(parse)

        def solve(observation: str) -> str:
            return f"\\boxed{{{solve_puzzle(board(observation), n)[0]}}}"

        return solve
