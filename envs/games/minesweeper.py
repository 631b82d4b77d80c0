"""Minesweeper: reveal every safe cell of a grid without hitting a mine."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, last_board

from rl2gem.core import StepResult

__all__ = ["MinesweeperEnv"]

_ROW = re.compile(r"^[ \d]\d [0-9.F]( [0-9.F])*$")  # a board row: right-aligned label, then cells
_MOVE = re.compile(r"^(reveal|flag|unflag)?\s*\(?\s*(\d+)\s*[, ]\s*(\d+)\s*\)?$", re.I)


class MinesweeperEnv(GameEnv):
    """Reveal all safe cells of a ``rows`` x ``cols`` grid hiding ``mines`` mines.

    Moves: ``\\boxed{reveal 2 3}`` (or just ``\\boxed{2 3}``) reveals row 2,
    column 3 (1-based); ``\\boxed{flag 2 3}`` / ``unflag`` marks a cell. Mines
    are placed after the first reveal, never on it or its neighbours, so the
    first move is always safe and opens an area. A revealed number counts the
    mines among the 8 neighbours; a 0 opens its neighbours. Revealing a mine
    loses (terminated, reward 0). Each reply shows the whole board (``.``
    hidden, ``F`` flag, digits revealed). Presets: ``easy`` 5x5 with 3 mines,
    ``medium`` 6x6 with 5, ``hard`` 8x8 with 10.
    """

    PRESETS = {
        "easy": {"rows": 5, "cols": 5, "mines": 3, "max_turns": 30},
        "medium": {"rows": 6, "cols": 6, "mines": 5, "max_turns": 40},
        "hard": {"rows": 8, "cols": 8, "mines": 10, "max_turns": 80},
    }

    def _check_params(self) -> None:
        if self.rows < 3 or self.cols < 3 or not 1 <= self.mines <= self.rows * self.cols - 9:
            raise ValueError("need rows, cols >= 3 and 1 <= mines <= rows*cols - 9")

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self.mine = np.zeros((self.rows, self.cols), dtype=bool)
        self.placed = False
        self.revealed = np.zeros_like(self.mine)
        self.flagged = np.zeros_like(self.mine)
        return (
            f"Let's play Minesweeper on a {self.rows}x{self.cols} grid with {self.mines} hidden mines. "
            "Reveal every safe cell. A number tells how many of the 8 neighbouring cells hold mines. "
            "Reveal a cell with \\boxed{reveal ROW COL} (1-based), flag one with \\boxed{flag ROW COL}. "
            f"Your first reveal is always safe.\n{self.board()}"
        ), {}

    def _neighbours(self, r: int, c: int):
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                rr, cc = r + dr, c + dc
                if (dr or dc) and 0 <= rr < self.rows and 0 <= cc < self.cols:
                    yield rr, cc

    def _count(self, r: int, c: int) -> int:
        return sum(self.mine[n] for n in self._neighbours(r, c))

    def board(self) -> str:
        rows = ["   " + " ".join(f"{c + 1}" for c in range(self.cols))]
        for r in range(self.rows):
            cells = []
            for c in range(self.cols):
                if self.revealed[r, c]:
                    cells.append("*" if self.mine[r, c] else str(self._count(r, c)))  # a lost game shows its mines
                else:
                    cells.append("F" if self.flagged[r, c] else ".")
            rows.append(f"{r + 1:>2} " + " ".join(cells))
        return "\n".join(rows)

    def _place(self, r: int, c: int) -> None:
        safe = {(r, c), *self._neighbours(r, c)}
        cells = [(i, j) for i in range(self.rows) for j in range(self.cols) if (i, j) not in safe]
        for k in self.np_random.choice(len(cells), size=self.mines, replace=False):
            self.mine[cells[int(k)]] = True
        self.placed = True

    def _open(self, r: int, c: int) -> None:
        stack = [(r, c)]
        while stack:
            cell = stack.pop()
            if self.revealed[cell]:
                continue
            self.revealed[cell] = True
            self.flagged[cell] = False
            if self._count(*cell) == 0:
                stack.extend(n for n in self._neighbours(*cell) if not self.revealed[n])

    def move_hint(self) -> str:
        return "Write \\boxed{reveal ROW COL} or \\boxed{flag ROW COL}."

    def _move(self, move: str) -> StepResult:
        m = _MOVE.match(move.strip())
        if not m:
            return self.malformed(move)
        kind, r, c = (m.group(1) or "reveal").lower(), int(m.group(2)) - 1, int(m.group(3)) - 1
        if not (0 <= r < self.rows and 0 <= c < self.cols):
            return self.invalid_action("cell off the board", f"({r + 1}, {c + 1}) is off the board.")
        if self.revealed[r, c]:
            return self.invalid_action(
                "cell already revealed", f"({r + 1}, {c + 1}) is already revealed.\n{self.board()}"
            )
        if kind != "reveal":
            self.flagged[r, c] = kind == "flag"
            return self.reply(self.board())
        if not self.placed:
            self._place(r, c)
        if self.mine[r, c]:
            self.revealed |= self.mine
            return self.lose(f"Boom! ({r + 1}, {c + 1}) was a mine.\n{self.board()}")
        self._open(r, c)
        if int((~self.revealed).sum()) == self.mines:
            return self.win(f"All safe cells revealed. You win!\n{self.board()}")
        return self.reply(self.board())

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        hidden = np.argwhere(~self.revealed) if getattr(self, "revealed", None) is not None else []
        if len(hidden):  # a cell not revealed yet
            r, c = (int(x) + 1 for x in hidden[int(rng.integers(len(hidden)))])
            return f"\\boxed{{reveal {r} {c}}}"
        return f"\\boxed{{reveal {int(rng.integers(1, self.rows + 1))} {int(rng.integers(1, self.cols + 1))}}}"

    def make_solver(self):
        """Reads the board text; reveals cells that the numbers prove safe, else the hidden
        cell least likely to be a mine (so it can lose on boards that need a guess)."""
        rows, cols, mines = self.rows, self.cols, self.mines

        def neighbours(r, c):
            return [
                (r + a, c + b)
                for a in (-1, 0, 1)
                for b in (-1, 0, 1)
                if (a or b) and 0 <= r + a < rows and 0 <= c + b < cols
            ]

        def parse(observation: str) -> list[list[str]] | None:
            lines = [ln for ln in observation.splitlines() if _ROW.match(ln)]
            return [ln.split()[1:] for ln in lines[-rows:]] if len(lines) >= rows else None

        board = last_board(parse)

        def solve(observation: str) -> str:
            grid = board(observation)
            if all(x == "." for row in grid for x in row):
                return f"\\boxed{{reveal {rows // 2 + 1} {cols // 2 + 1}}}"
            mine, safe = set(), set()
            changed = True
            while changed:
                changed = False
                for r in range(rows):
                    for c in range(cols):
                        if not grid[r][c].isdigit():
                            continue
                        hidden = [n for n in neighbours(r, c) if grid[n[0]][n[1]] in ".F" and n not in safe]
                        known = [n for n in hidden if n in mine]
                        unknown = [n for n in hidden if n not in mine]
                        need = int(grid[r][c]) - len(known)
                        if unknown and need == len(unknown):
                            mine.update(unknown)
                            changed = True
                        elif unknown and need == 0:
                            safe.update(unknown)
                            changed = True
            if safe:
                r, c = min(safe)
                return f"\\boxed{{reveal {r + 1} {c + 1}}}"
            hidden = [(r, c) for r in range(rows) for c in range(cols) if grid[r][c] in ".F" and (r, c) not in mine]
            density = (mines - len(mine)) / max(1, len(hidden))

            def risk(cell):
                worst = density
                for n in neighbours(*cell):
                    if grid[n[0]][n[1]].isdigit():
                        hid = [x for x in neighbours(*n) if grid[x[0]][x[1]] in ".F"]
                        k = int(grid[n[0]][n[1]]) - sum(x in mine for x in hid)
                        free = [x for x in hid if x not in mine]
                        worst = max(worst, k / max(1, len(free)))
                return worst

            r, c = min(hidden, key=risk)
            return f"\\boxed{{reveal {r + 1} {c + 1}}}"

        return solve
