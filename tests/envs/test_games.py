"""Every game: a solver that reads only the observations wins; rules checked on hand-made cases."""

import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from rl2gem.envs import GAMES
from rl2gem.envs.games.fifteen_puzzle import FifteenPuzzleEnv, solve_puzzle
from rl2gem.envs.games.hangman import HangmanEnv
from rl2gem.envs.games.mastermind import MastermindEnv, score_guess
from rl2gem.envs.games.minesweeper import MinesweeperEnv
from rl2gem.envs.games.sudoku import SudokuEnv, count_solutions
from rl2gem.envs.games.tower_of_hanoi import TowerOfHanoiEnv, next_move
from rl2gem.envs.games.wordle import WordleEnv, feedback

import rl2gem

# Fraction of 20 seeded games the scripted solver must win. Minesweeper can need a
# blind guess and Wordle/Hangman can run out of turns on rare words; the rest are exact.
MIN_WIN_RATE = {"Minesweeper": 0.6, "Wordle": 0.85, "Hangman": 0.85}


def play(env, seed):
    obs, _ = env.reset(seed=seed)
    solver = env.unwrapped.make_solver()
    total, done = 0.0, False
    while not done:
        obs, r, term, trunc, info = env.step(solver(obs))
        assert not info["invalid_action"], (obs, info)  # the solver only makes legal moves
        total += r
        done = term or trunc
    return total, info


@pytest.mark.parametrize("name", sorted(GAMES))
@pytest.mark.parametrize("level", ["Easy", "Hard"])
def test_solver_wins(name, level):
    env = gym.make(f"rl2/{name}-{level}-v0")
    results = [play(env, seed) for seed in range(20)]
    wins = [total == 1.0 and info["success"] for total, info in results]
    assert np.mean(wins) >= MIN_WIN_RATE.get(name, 1.0), wins
    assert all(total in (0.0, 1.0) for total, _ in results)  # success 1.0, no shaping


@pytest.mark.parametrize("name", sorted(GAMES))
def test_the_solver_goes_on_after_an_invalid_move_without_a_board(name):
    """An invalid move's correction carries no board; the solver plays on from the last board it
    read (the position did not change) and wins as it does without the invalid move."""
    env = gym.make(f"rl2/{name}-Easy-v0", max_turns=200)  # room for the invalid move
    for seed in range(10):  # the first game whose first move does not end it
        expected, _ = play(env, seed)
        obs, _ = env.reset(seed=seed)
        solver = env.unwrapped.make_solver()
        obs, r, term, trunc, info = env.step(solver(obs))
        if not term:
            break
    solver(obs)  # read, then a move of its own (the solvers read one observation twice alike)
    obs, r, term, trunc, info = env.step("\\boxed{!!}")
    assert info["invalid_action"] and not term and "\n" not in obs.strip()  # no board
    total = r
    while not (term or trunc):
        obs, r, term, trunc, info = env.step(solver(obs))
        total += r
    assert total == expected


@pytest.mark.parametrize("name", sorted(GAMES))
def test_random_moves_and_garbage_never_raise(name):
    env = gym.make(f"rl2/{name}-Easy-v0")
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    obs, r, term, trunc, info = env.step("no box here")
    assert info["invalid_action"] == "no \\boxed{} move" and "\\boxed" in obs and not term
    for action in ["\\boxed{}", "\\boxed{???}", "\\boxed{999 999 999}", "\\boxed{" + "9" * 500 + "}"]:
        obs, r, term, trunc, info = env.step(action)
        assert isinstance(obs, str) and r == 0.0
        if term or trunc:
            env.reset(seed=1)
    for _ in range(50):
        obs, r, term, trunc, info = env.step(env.unwrapped.sample_random_action(rng))
        assert "\\boxed{" in env.unwrapped.sample_random_action(rng)
        if term or trunc:
            env.reset()


def test_presets_and_overrides():
    assert rl2gem.make("rl2/Mastermind-Easy-v0").unwrapped.code_length == 3
    env = rl2gem.make("rl2/Mastermind-v0", code_length=5, max_turns=3)
    assert env.unwrapped.code_length == 5 and env.unwrapped.max_turns == 3
    with pytest.raises(ValueError, match="difficulty"):
        rl2gem.make("rl2/Sudoku-v0", difficulty="nightmare")
    with pytest.raises(TypeError, match="unknown argument"):
        rl2gem.make("rl2/Sudoku-v0", colour="red")


def test_mastermind_pegs():
    assert score_guess("1234", "1234") == (4, 0)
    assert score_guess("1234", "4321") == (0, 4)
    assert score_guess("1122", "1212") == (2, 2)
    assert score_guess("1123", "1111") == (2, 0)
    env = MastermindEnv("easy")
    env.reset(seed=0)
    env.code = "123"
    obs, r, *_ = env.step("\\boxed{132}")
    assert obs == "Guess 132: 1 black, 2 white." and r == 0.0
    assert env.step("\\boxed{12}")[4]["invalid_action"] == "malformed guess"
    assert env.step("\\boxed{1 2 3}")[1] == 1.0


def test_wordle_marks_repeated_letters_like_the_original():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("abbey", "babes") == "YYGGX"
    assert feedback("robot", "ooooo") == "XGXGX"  # only two o's: the greens take them
    assert feedback("hello", "lllll") == "XXGGX"
    env = WordleEnv("hard")
    env.reset(seed=3)
    assert env.secret in env.secrets and len(env.secrets) == 5041
    assert env.step("\\boxed{zzzzz}")[4]["invalid_action"] == "unknown word"
    assert env.step("\\boxed{toolong}")[4]["invalid_action"] == "not a word of the right length"
    obs, r, term, *_ = env.step("\\boxed{" + env.secret + "}")
    assert r == 1.0 and term and "GGGGG" in obs


def test_hangman_misses_lose_and_repeats_are_invalid():
    env = HangmanEnv("hard")
    env.reset(seed=0)
    absent = [c for c in "zqxjkvwyfbgpmhu" if c not in env.secret]
    assert env.step("\\boxed{" + absent[0] + "}")[4]["invalid_action"] is None
    assert env.step("\\boxed{" + absent[0] + "}")[4]["invalid_action"] == "already guessed"
    wrong = "zzzzz" if env.secret != "zzzzz" else "qqqqq"  # a wrong word again is a repeat too, not a free move
    assert env.step("\\boxed{" + wrong + "}")[4]["invalid_action"] is None and len(env.missed) == 2
    assert env.step("\\boxed{" + wrong + "}")[4]["invalid_action"] == "already guessed"
    for c in absent[1:5]:
        obs, r, term, trunc, info = env.step("\\boxed{" + c + "}")
    assert term and r == 0.0 and "You lost" in obs and not info["success"]
    env.reset(seed=0)
    assert env.step("\\boxed{" + env.secret + "}")[1] == 1.0  # the whole word at once


def test_minesweeper_first_reveal_is_safe_and_a_mine_loses():
    for seed in range(30):
        env = MinesweeperEnv("hard")
        env.reset(seed=seed)
        obs, r, term, *_ = env.step("\\boxed{reveal 1 1}")
        assert not term and env.mine.sum() == env.mines and not env.mine[:2, :2].any()
        assert obs.splitlines()[1].split()[1] != "."  # the corner area opened
    r_, c_ = map(int, np.argwhere(env.mine)[0])
    obs, r, term, *_ = env.step(f"\\boxed{{reveal {r_ + 1} {c_ + 1}}}")
    assert term and r == 0.0 and obs.startswith("Boom")


def test_sudoku_puzzles_have_unique_solutions_and_mistakes_count():
    for level in ("easy", "hard"):
        env = SudokuEnv(level)
        env.reset(seed=4)
        assert (env.grid == 0).sum() == env.blanks
        assert count_solutions(env.grid.copy(), env.box) == 1
        n = env.box**2
        assert all(sorted(env.solution[r]) == list(range(1, n + 1)) for r in range(n))
    env = SudokuEnv("easy")
    env.reset(seed=0)
    r, c = map(int, np.argwhere(env.grid == 0)[0])
    wrong = next(d for d in range(1, 5) if d != env.solution[r, c])
    for k in range(3):
        obs, rew, term, trunc, info = env.step(f"\\boxed{{{r + 1} {c + 1} {wrong}}}")
        assert info["mistakes"] == k + 1
    assert term and rew == 0.0 and "Game over" in obs


def test_hanoi_rules_and_optimal_play():
    assert next_move({"A": [3, 2, 1], "B": [], "C": []}) == ("A", "C")
    assert next_move({"A": [3], "B": [2, 1], "C": []}) == ("A", "C")
    env = TowerOfHanoiEnv("medium")
    env.reset(seed=0)
    env.step("\\boxed{A B}")  # disk 1 to B
    assert env.step("\\boxed{A B}")[4]["invalid_action"] == "larger disk on a smaller one"
    assert env.step("\\boxed{C A}")[4]["invalid_action"] == "empty peg"
    _, info = play(gym.make("rl2/TowerOfHanoi-Hard-v0"), 0)
    assert info["turn"] == 2**5 - 1  # the solver plays a shortest solution


def test_fifteen_puzzle_solver_is_optimal_and_bad_tiles_are_invalid():
    assert solve_puzzle((1, 2, 3, 4, 5, 6, 7, 0, 8), 3) == [8]
    assert solve_puzzle((1, 2, 3, 4, 0, 6, 7, 5, 8), 3) == [5, 8]
    env = FifteenPuzzleEnv("easy")
    env.reset(seed=0)
    blank = env.state.index(0)
    far = next(t for i, t in enumerate(env.state) if t and abs(i // 3 - blank // 3) + abs(i % 3 - blank % 3) > 1)
    assert env.step(f"\\boxed{{{far}}}")[4]["invalid_action"] == "tile not next to the blank"
    total, info = play(gym.make("rl2/FifteenPuzzle-Easy-v0"), 0)
    assert total == 1.0 and info["turn"] <= 8


def test_running_out_of_moves_loses_the_game_and_shows_the_answer():
    """The last allowed move that did not win truncated the episode (a value bootstrapped past a lost
    game) with no word that it was lost; now it terminates as a loss, the answer shown."""
    env = rl2gem.make("rl2/GuessTheNumber-Easy-v0")
    env.reset(seed=4)
    target, limit = env.unwrapped.target, env.unwrapped.max_turns
    wrong = env.unwrapped.min_number if target != env.unwrapped.min_number else target + 1
    for turn in range(limit):
        obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{wrong}}}")
        assert terminated == (turn == limit - 1) and not truncated and reward == 0.0
    assert info["success"] is False and obs.endswith(f"No moves left: you lost. The number was {target}.")
    env = rl2gem.make("rl2/Wordle-v0")
    env.reset(seed=0)
    for _ in range(env.unwrapped.max_turns - 1):
        env.step("no move")  # invalid moves count as turns too
    obs, _, terminated, truncated, info = env.step("still none")
    assert terminated and not truncated and f"The word was '{env.unwrapped.secret}'." in obs


def test_a_lost_minesweeper_board_shows_its_mines_and_small_boards_are_refused():
    env = rl2gem.make("rl2/Minesweeper-v0")
    env.reset(seed=1)
    env.step("\\boxed{1 1}")  # the first reveal is safe
    rows, cols = np.nonzero(env.unwrapped.mine & ~env.unwrapped.revealed)
    obs, _, terminated, *_ = env.step(f"\\boxed{{{rows[0] + 1} {cols[0] + 1}}}")
    assert terminated and obs.count("*") == int(env.unwrapped.mine.sum())  # mines were shown as counts
    with pytest.raises(ValueError, match="size must be 3..5"):
        rl2gem.make("rl2/FifteenPuzzle-v0", size=2, scramble=12)  # 2x2 scrambles of 12 hung in reset


def test_the_hangman_solver_plays_the_same_in_every_process():
    """Its ties between letters were broken in set order, which changes with PYTHONHASHSEED."""
    code = (
        "import rl2gem\nenv = rl2gem.make('rl2/Hangman-v0')\nobs, _ = env.reset(seed=4)\n"
        "solve, moves = env.unwrapped.make_solver(), []\n"
        "for _ in range(6):\n    move = solve(obs)\n    moves.append(move)\n    obs, _, t, tr, _ = env.step(move)\n"
        "    if t or tr: break\nprint(moves)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1 and "boxed" in outputs.pop()


def test_a_turn_budget_that_cannot_win_is_refused():
    """TowerOfHanoi with 6 disks in its 40 moves (63 needed) or Sudoku with fewer moves than blanks
    were made without a word, and no policy could ever win them."""
    with pytest.raises(ValueError, match="max_turns=40 cannot solve 6 disks: it takes 63 moves"):
        rl2gem.make("rl2/TowerOfHanoi-v0", disks=6)
    with pytest.raises(ValueError, match="cannot fill 45 blanks"):
        rl2gem.make("rl2/Sudoku-v0", max_turns=20)
    assert rl2gem.make("rl2/TowerOfHanoi-v0", disks=6, max_turns=63).unwrapped.max_turns == 63


@pytest.mark.parametrize("game", ["FifteenPuzzle", "TowerOfHanoi", "Sudoku", "Minesweeper", "Hangman"])
def test_random_actions_are_legal_moves(game):
    """sample_random_action drew from every move of the right form: 44-78% were refused (a tile not
    next to the blank, a filled cell, a revealed cell, a letter guessed before), so policy=random
    and check_env mostly measured invalid moves."""
    env = rl2gem.make(f"rl2/{game}-v0")
    refused = played = 0
    for seed in range(5):
        env.reset(seed=seed)
        done = False
        while not done:
            *_, terminated, truncated, info = env.step(env.unwrapped.sample_random_action())
            refused += bool(info.get("invalid_action"))
            played += 1
            done = terminated or truncated
    assert played > 5 and refused == 0


@pytest.mark.parametrize("name", sorted(GAMES))
def test_sampling_an_action_changes_nothing_the_game_draws(name):
    """An agent that samples a random action and then plays another (epsilon-greedy) gets the
    episode of the same seed and moves: Minesweeper placed its mines at the first reveal from the
    generator ``sample_random_action`` had drawn from. One seed still samples the same actions."""
    boards, samples = [], []
    for sample_first in (False, True):
        env = rl2gem.make(f"rl2/{name}-v0")
        env.reset(seed=3)
        solver = env.unwrapped.make_solver()
        drawn = [env.unwrapped.sample_random_action() for _ in range(3 if sample_first else 0)]
        obs, _ = env.reset(seed=3)
        if sample_first:
            samples.append(drawn + [env.unwrapped.sample_random_action() for _ in range(2)])
            env.reset(seed=3)
            samples.append(drawn + [env.unwrapped.sample_random_action() for _ in range(2)])
            obs, _ = env.reset(seed=3)
            env.unwrapped.sample_random_action()
        trajectory = [obs]
        for _ in range(3):
            obs, *_, terminated, truncated, _ = env.step(solver(obs))
            trajectory.append(obs)
            if terminated or truncated:
                break
        boards.append(trajectory)
    assert boards[0] == boards[1]
    assert samples[0] == samples[1]


def test_bad_hangman_limits_and_an_unlimited_game_are_refused_when_made():
    """``max_misses=0`` lost on a correct guess, a length without words failed at reset, and
    ``max_turns=None`` (no limit for other envs) silently kept the preset's limit."""
    for options, message in [
        ({"max_misses": 0}, "max_misses must be an int >= 1, got 0"),
        ({"min_length": 30, "max_length": 40}, "no word of 30-40 letters"),
    ]:
        with pytest.raises(ValueError, match=message):
            rl2gem.make("rl2/Hangman-v0", **options)
    with pytest.raises(ValueError, match="max_turns=None: a game's turn limit is part of it"):
        gym.make("rl2/Wordle-v0", max_turns=None)
