"""The built-in environments of rl2gem, registered under the Gymnasium namespace ``rl2``.

Entry points are strings, so no env module is imported until ``make``.
``rl2gem.list_envs()`` lists the ids; the README has the table.
"""

from rl2gem.registry import register

_MATH = "rl2gem.envs.math:MathEnv"
register("rl2/Math-v0", _MATH)  # dataset= any source, see rl2gem.envs.math
register("rl2/GSM8K-v0", _MATH, dataset="gsm8k", split="train")
register("rl2/MATH500-v0", _MATH, dataset="math500", split="test")
register("rl2/AIME24-v0", _MATH, dataset="aime24", split="test")
register("rl2/AIME25-v0", _MATH, dataset="aime25", split="test")

_RG = "rl2gem.envs.reasoning_gym:ReasoningGymEnv"
register("rl2/ReasoningGym-v0", _RG)  # task= any reasoning-gym dataset
register("rl2/Countdown-v0", _RG, task="countdown")

register("rl2/SearchQA-v0", "rl2gem.envs.search_qa:SearchQAEnv")
register("rl2/MultiHopQA-v0", "rl2gem.envs.search_qa:SearchQAEnv", hops=2)  # two searches per question

# Tool use: math with a Python sandbox; BFCL function calling (single turn) and
# multi-turn tool use over BFCL's executable back-ends.
register("rl2/PythonMath-v0", "rl2gem.envs.python_math:make_python_math")
register("rl2/FunctionCall-v0", "rl2gem.envs.bfcl:FunctionCallEnv")  # category= one or "all"
register("rl2/ToolUse-v0", "rl2gem.envs.bfcl:ToolUseEnv")  # category= base | long_context | miss_param
register("rl2/Remote-v0", "rl2gem.remote:RemoteEnv")  # url= a python -m rl2gem.envserver server

#: Multi-turn games: ``rl2/<Game>-v0`` uses the game's default difficulty (``hard``, or
#: ``medium`` where named below); ``-Easy-v0`` / ``-Hard-v0`` fix a preset; every id also
#: takes ``difficulty=`` and the preset's own keyword arguments.
GAMES = {
    "GuessTheNumber": "guess_the_number:GuessTheNumberEnv",
    "Mastermind": "mastermind:MastermindEnv",
    "Wordle": "wordle:WordleEnv",
    "Hangman": "hangman:HangmanEnv",
    "Minesweeper": "minesweeper:MinesweeperEnv",
    "Sudoku": "sudoku:SudokuEnv",
    "TowerOfHanoi": "tower_of_hanoi:TowerOfHanoiEnv",
    "FifteenPuzzle": "fifteen_puzzle:FifteenPuzzleEnv",
}
for _name, _target in GAMES.items():
    _entry = f"rl2gem.envs.games.{_target}"
    register(f"rl2/{_name}-v0", _entry)
    register(f"rl2/{_name}-Easy-v0", _entry, difficulty="easy")
    register(f"rl2/{_name}-Hard-v0", _entry, difficulty="hard")
