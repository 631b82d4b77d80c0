"""Tower of Hanoi: move the stack from peg A to peg C, one disk at a time, never a larger on a smaller."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from rl2gem.envs.games.base import GameEnv, last_board

from rl2gem.core import StepResult

__all__ = ["TowerOfHanoiEnv", "next_move"]

_MOVE = re.compile(r"^([ABC])\s*(?:->|to|,|\s)\s*([ABC])$", re.I)
_PEG = re.compile(r"^([ABC]): ?([\d ]*)$", re.M)


def next_move(pegs: dict[str, list[int]], target: str = "C") -> tuple[str, str]:
    """The first move of a shortest solution from any legal position (disks 1 = smallest)."""
    where = {d: p for p, stack in pegs.items() for d in stack}

    def solve(disk: int, goal: str) -> tuple[str, str] | None:
        # the first move that brings disks 1..disk onto goal, or None when they already are
        if disk == 0:
            return None
        src = where[disk]
        if src == goal:
            return solve(disk - 1, goal)
        spare = ({"A", "B", "C"} - {src, goal}).pop()
        first = solve(disk - 1, spare)
        return first if first is not None else (src, goal)

    move = solve(len(where), target)
    if move is None:
        raise ValueError("already solved")
    return move


class TowerOfHanoiEnv(GameEnv):
    """Move ``disks`` disks from peg A to peg C.

    A move ``\\boxed{A C}`` takes the top disk of A onto C. Putting a disk on a
    smaller one, or moving from an empty peg, is an invalid move (not made).
    The optimal solution takes ``2**disks - 1`` moves; the turn limit leaves
    some slack. Presets: ``easy`` 3 disks / 10 turns, ``medium`` 4 / 20,
    ``hard`` 5 / 40. The observation after each move shows the pegs, bottom
    disk first (1 is the smallest).
    """

    PRESETS = {
        "easy": {"disks": 3, "max_turns": 10},
        "medium": {"disks": 4, "max_turns": 20},
        "hard": {"disks": 5, "max_turns": 40},
    }

    def _check_params(self) -> None:
        if not 1 <= self.disks <= 9:
            raise ValueError("disks must be 1..9")
        if self.max_turns < 2**self.disks - 1:  # the fewest moves that solve it
            raise ValueError(
                f"max_turns={self.max_turns} cannot solve {self.disks} disks: it takes {2**self.disks - 1} moves"
            )

    def pegs_text(self) -> str:
        return "\n".join(f"{p}: {' '.join(map(str, s))}".rstrip() for p, s in self.pegs.items())

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self.pegs = {"A": list(range(self.disks, 0, -1)), "B": [], "C": []}
        return (
            f"Tower of Hanoi with {self.disks} disks (1 is the smallest). Move the whole stack from peg A to peg C. "
            "Move one top disk per turn, never onto a smaller disk, written like \\boxed{A C} (from A to C). "
            f"You have {self.max_turns} moves. Pegs are listed bottom to top:\n{self.pegs_text()}"
        ), {}

    def move_hint(self) -> str:
        return "Write \\boxed{FROM TO} with pegs A, B, C, e.g. \\boxed{A C}."

    def _move(self, move: str) -> StepResult:
        m = _MOVE.match(move.strip())
        if not m:
            return self.malformed(move)
        src, dst = m.group(1).upper(), m.group(2).upper()
        if src == dst:
            return self.invalid_action("same peg", "Take the disk to another peg.")
        if not self.pegs[src]:
            return self.invalid_action("empty peg", f"Peg {src} is empty.\n{self.pegs_text()}")
        disk = self.pegs[src][-1]
        if self.pegs[dst] and self.pegs[dst][-1] < disk:
            return self.invalid_action(
                "larger disk on a smaller one",
                f"Disk {disk} cannot go on disk {self.pegs[dst][-1]}.\n{self.pegs_text()}",
            )
        self.pegs[dst].append(self.pegs[src].pop())
        if len(self.pegs["C"]) == self.disks:
            return self.win(f"All disks are on C. Solved!\n{self.pegs_text()}")
        return self.reply(self.pegs_text())

    def sample_random_action(self, rng: np.random.Generator | None = None) -> str:
        rng = self.action_rng(rng)
        pegs = getattr(self, "pegs", None)
        moves = [  # legal: a top disk onto an empty peg or a larger one
            (a, b)
            for a in "ABC"
            for b in "ABC"
            if a != b and pegs and pegs[a] and (not pegs[b] or pegs[b][-1] > pegs[a][-1])
        ]
        a, b = moves[int(rng.integers(len(moves)))] if moves else rng.choice(list("ABC"), size=2, replace=False)
        return f"\\boxed{{{a} {b}}}"

    def make_solver(self):
        """Parses the pegs and plays the first move of a shortest solution from there."""

        def parse(observation: str) -> dict[str, list[int]] | None:
            pegs = {p: [int(x) for x in s.split()] for p, s in _PEG.findall(observation)[-3:]}
            return pegs if len(pegs) == 3 else None

        board = last_board(parse)

        def solve(observation: str) -> str:
            src, dst = next_move(board(observation))
            return f"\\boxed{{{src} {dst}}}"

        return solve
