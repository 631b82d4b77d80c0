"""Math with a Python interpreter: ``rl2/PythonMath-v0``.

The problems, the answer format (``\\boxed{}``) and the reward are those of
:mod:`rl2gem.envs.math` (math-verify against the reference); the agent may
also run Python in the sandbox (:class:`rl2gem.tools.PythonTool`) through
``<tool_call>`` blocks before it answers. The episode ends at the first reply
without a tool call (scored), or is truncated when a turn asks for more than
``max_tool_calls`` calls in all.
"""

from __future__ import annotations

from collections.abc import Mapping

from rl2gem.envs.math import MathEnv

from rl2gem.tools import PythonTool, SandboxConfig, ToolEnvWrapper

__all__ = ["make_python_math", "INSTRUCTION"]

INSTRUCTION = (
    "Solve the following math problem. You may run Python code to compute or check intermediate results "
    "(the python tool; print what you need to see). "
    "Put your final answer in \\boxed{}, for example: \\boxed{42}."
)


def make_python_math(
    dataset: str | Mapping[str, str] = "gsm8k",
    split: str = "train",
    *,
    max_tool_calls: int = 4,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_chars: int = 2048,
    instruction: str = INSTRUCTION,
    tool_prompt: str | None = "append",
    persistent: bool = False,
    pool_size: int = 1,
    render_mode: str | None = None,
) -> ToolEnvWrapper:
    """``rl2/PythonMath-v0``: :class:`~rl2gem.envs.math.MathEnv` with a :class:`~rl2gem.tools.PythonTool`.

    Args:
        dataset, split, instruction: as for :class:`~rl2gem.envs.math.MathEnv`.
        max_tool_calls: Python runs allowed per episode.
        timeout_s, memory_mb, max_output_chars: sandbox limits per run
            (:class:`~rl2gem.tools.SandboxConfig`).
        tool_prompt: where the tool list and call format go in the first observation:
            ``"append"`` (default) or ``"prepend"``; ``None`` leaves them to the chat
            template (``info["tools"]``, ``RolloutConfig(tools_in_template=True)``).
        persistent: one sandboxed interpreter per episode, whose variables persist across
            that episode's calls (:class:`~rl2gem.tools.PythonSession`); default: each call
            is a fresh process.
        pool_size: fork servers that fork the executions (the warm pool, the default);
            ``0`` starts a fresh interpreter per call.

    Raises:
        ValueError: a bad ``tool_prompt`` or sandbox limit.
    """
    env = MathEnv(dataset, split, instruction=instruction, render_mode=render_mode)
    config = SandboxConfig(
        timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars, pool_size=pool_size
    )
    tool = PythonTool(config, persistent=persistent)
    return ToolEnvWrapper(env, [tool], max_tool_calls=max_tool_calls, prompt=tool_prompt)
