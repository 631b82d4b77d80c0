"""Sudoku: fill the grid so each row, column and box holds every digit once."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, last_board

from rl2gem.core import StepResult

__all__ = ["SudokuEnv", "solve_grid", "count_solutions"]

_MOVE = re.compile(r"^\(?\s*(\d+)\s*[, ]\s*(\d+)\s*\)?\s*[, =:]\s*(\d+)$")


def _candidates(grid: np.ndarray, r: int, c: int, box: int) -> set[int]:
    n = grid.shape[0]
    br, bc = r - r % box, c - c % box
    used = set(grid[r]) | set(grid[:, c]) | set(grid[br : br + box, bc : bc + box].ravel())
    return {d for d in range(1, n + 1) if d not in used}


def count_solutions(grid: np.ndarray, box: int, limit: int = 2) -> int:
    """Number of completions of ``grid`` (0 = empty cell), counting up to ``limit``."""
    empties = list(zip(*np.nonzero(grid == 0), strict=True))
    if not empties:
        return 1
    r, c, cands = min(((r, c, _candidates(grid, r, c, box)) for r, c in empties), key=lambda t: len(t[2]))
    total = 0
    for d in cands:
        grid[r, c] = d
        total += count_solutions(grid, box, limit - total)
        grid[r, c] = 0
        if total >= limit:
            break
    return total


def solve_grid(grid: np.ndarray, box: int) -> np.ndarray | None:
    """A completion of ``grid`` by backtracking with the fewest-candidates cell first, or ``None``."""
    grid = grid.copy()

    def rec() -> bool:
        empties = list(zip(*np.nonzero(grid == 0), strict=True))
        if not empties:
            return True
        r, c, cands = min(((r, c, _candidates(grid, r, c, box)) for r, c in empties), key=lambda t: len(t[2]))
        for d in sorted(cands):
            grid[r, c] = d
            if rec():
                return True
        grid[r, c] = 0
        return False

    return grid if rec() else None


class SudokuEnv(GameEnv):
    """Fill an ``n`` x ``n`` Sudoku (``n = box**2``) with a unique solution.

    A move places one digit: ``\\boxed{3 5 7}`` puts 7 at row 3, column 5
    (1-based). A digit that breaks a row, column or box rule, or that differs
    from the (unique) solution, is a mistake: reported, not placed, counted in
    ``info["mistakes"]``; ``max_mistakes`` mistakes lose the game. Filling the
    last cell wins. Presets: ``easy`` 4x4 with 6 blanks, ``medium`` 9x9 with 30
    blanks, ``hard`` 9x9 with 45 blanks. Puzzles are generated from the seed:
    a shuffled valid grid, then cells removed while the solution stays unique.
    """

    PRESETS = {
        "easy": {"box": 2, "blanks": 6, "max_mistakes": 3, "max_turns": 12},
        "medium": {"box": 3, "blanks": 30, "max_mistakes": 5, "max_turns": 40},
        "hard": {"box": 3, "blanks": 45, "max_mistakes": 5, "max_turns": 55},
    }

    def _check_params(self) -> None:
        if self.box not in (2, 3) or not 1 <= self.blanks <= self.box**4 - 1:
            raise ValueError("box must be 2 or 3 and blanks in 1..n*n-1")
        if self.max_turns < self.blanks:  # one cell per move
            raise ValueError(f"max_turns={self.max_turns} cannot fill {self.blanks} blanks, one per move")

    def _generate(self) -> tuple[np.ndarray, np.ndarray]:
        b, n, rng = self.box, self.box**2, self.np_random
        base = np.array([[(b * (r % b) + r // b + c) % n for c in range(n)] for r in range(n)]) + 1
        digits = rng.permutation(n) + 1
        solution = digits[base - 1]
        bands = rng.permutation(b)
        rows = [band * b + r for band in bands for r in rng.permutation(b)]
        stacks = rng.permutation(b)
        cols = [stack * b + c for stack in stacks for c in rng.permutation(b)]
        solution = solution[rows][:, cols]
        puzzle = solution.copy()
        removed = 0
        for cell in rng.permutation(n * n):
            if removed == self.blanks:
                break
            r, c = divmod(int(cell), n)
            keep = puzzle[r, c]
            puzzle[r, c] = 0
            if count_solutions(puzzle.copy(), b) == 1:
                removed += 1
            else:
                puzzle[r, c] = keep
        return puzzle, solution

    def grid_text(self) -> str:
        n, b = self.box**2, self.box
        out = []
        for r in range(n):
            row = " ".join(str(d) if d else "." for d in self.grid[r])
            out.append(row)
            if (r + 1) % b == 0 and r + 1 < n:
                out.append("")
        return "\n".join(out)

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self.grid, self.solution = self._generate()
        self.mistakes = 0
        n = self.box**2
        return (
            f"Solve this {n}x{n} Sudoku: fill the dots so every row, column and {self.box}x{self.box} box "
            f"holds each digit 1-{n} once. Place one digit per turn as \\boxed{{ROW COL DIGIT}} (1-based), "
            f"e.g. \\boxed{{1 2 {n}}}. {self.max_mistakes} mistakes and you lose.\n{self.grid_text()}"
        ), {"blanks": int((self.grid == 0).sum())}

    def move_hint(self) -> str:
        return "Write \\boxed{ROW COL DIGIT}."

    def _move(self, move: str) -> StepResult:
        m = _MOVE.match(move.strip())
        n = self.box**2
        if not m:
            return self.malformed(move)
        r, c, d = int(m.group(1)) - 1, int(m.group(2)) - 1, int(m.group(3))
        if not (0 <= r < n and 0 <= c < n and 1 <= d <= n):
            return self.invalid_action("out of range", f"Rows, columns and digits go from 1 to {n}.")
        if self.grid[r, c]:
            return self.invalid_action("cell already filled", f"Row {r + 1}, column {c + 1} is already filled.")
        if d != self.solution[r, c]:
            self.mistakes += 1
            why = (
                "breaks a row, column or box"
                if d not in _candidates(self.grid, r, c, self.box)
                else "leads to no solution"
            )
            text = f"{d} at row {r + 1}, column {c + 1} {why}. Mistakes: {self.mistakes}/{self.max_mistakes}."
            if self.mistakes >= self.max_mistakes:
                return self.lose(text + " Game over.", mistakes=self.mistakes)
            return self.reply(f"{text}\n{self.grid_text()}", mistakes=self.mistakes)
        self.grid[r, c] = d
        if not (self.grid == 0).any():
            return self.win(f"Solved!\n{self.grid_text()}", mistakes=self.mistakes)
        return self.reply(self.grid_text(), mistakes=self.mistakes)

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        n = self.box**2
        r, c, d = (int(x) for x in rng.integers(1, n + 1, size=3))
        if getattr(self, "grid", None) is not None:  # an empty cell (the digit may be a mistake)
            empty = np.argwhere(self.grid == 0)
            if len(empty):
                r, c = (int(x) + 1 for x in empty[int(rng.integers(len(empty)))])
        return f"\\boxed{{{r} {c} {d}}}"

    def make_solver(self):
        """Parses the grid from the observation, solves it by backtracking, places one digit."""
        n, box = self.box**2, self.box

        def parse(observation: str) -> np.ndarray | None:
            rows = [ln.split() for ln in observation.splitlines() if re.fullmatch(r"[\d.]( [\d.])*", ln.strip())]
            rows = [r for r in rows if len(r) == n][-n:]
            return np.array([[0 if x == "." else int(x) for x in row] for row in rows]) if len(rows) == n else None

        board = last_board(parse)

        def solve(observation: str) -> str:
            grid = board(observation)
            full = solve_grid(grid, box)
            r, c = map(int, np.argwhere(grid == 0)[0])
            return f"\\boxed{{{r + 1} {c + 1} {full[r, c]}}}"

        return solve
