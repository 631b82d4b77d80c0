"""Tool use for any rl2gem env: :class:`ToolEnvWrapper`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from rl2gem.core import ResetResult, StepResult, Wrapper, _PrivateLoop, fit_observation, fit_tool_results
from rl2gem.tools.base import (
    Tool,
    ToolArgumentError,
    ToolCall,
    parse_tool_calls,
    tool_schema,
    tools_prompt,
    validate_arguments,
)

__all__ = ["ToolEnvWrapper", "env_tools", "run_tool_calls", "format_tool_results"]


def _for_episode(tool: Tool) -> Tool:
    """``tool.episode()`` where the tool has it (a tool with state per episode), else the tool."""
    episode = getattr(tool, "episode", None)
    return episode() if callable(episode) else tool


async def run_tool_calls(tools: dict[str, Tool], calls: Sequence[ToolCall]) -> list[tuple[str, str | None]]:
    """Run ``calls`` one after another (in order: stateful tools see the calls in the model's order).

    Returns:
        one ``(result_text, error)`` per call; ``error`` is ``None`` when the
        tool ran (its own failures are part of its text), else why it did not
        run (malformed call, unknown tool, arguments not matching the schema).
        Never raises for a bad call or a failing tool.
    """
    out: list[tuple[str, str | None]] = []
    for call in calls:
        if call.error is not None:
            out.append((f"Error: {call.error}. No tool was run.", call.error))
            continue
        tool = tools.get(call.name)
        if tool is None:
            err = f"unknown tool {call.name!r}"
            out.append((f"Error: {err}; the available tools are {', '.join(sorted(tools)) or 'none'}.", err))
            continue
        try:
            validate_arguments(tool, call.arguments)
        except ToolArgumentError as e:
            out.append((f"Error: invalid arguments: {e}.", str(e)))
            continue
        try:
            text = await tool.call(call.arguments)
        except Exception as e:  # a tool must not crash the episode
            out.append((f"Error: the tool {call.name} failed: {type(e).__name__}: {e}", None))
            continue
        out.append((text if isinstance(text, str) else str(text), None))
    return out


def env_tools(env: gym.Env) -> list[Tool]:
    """The tools an env gives its agent: those its outermost :class:`ToolEnvWrapper` offers (the
    inner wrappers' first), then the ``agent_tools()`` of the unwrapped env where it has that
    method (an env whose actions call a service, e.g. ``rl2/SearchQA-v0``'s search). What
    ``python -m rl2gem.envserver ENV_ID --mcp`` serves.

    Raises:
        ValueError: two tools with one name.
    """
    tools: list[Tool] = []
    layer = env
    while isinstance(layer, gym.Wrapper):
        if isinstance(layer, ToolEnvWrapper):
            tools.extend(layer.offered_tools().values())
            break
        layer = layer.env
    own = getattr(env.unwrapped, "agent_tools", None)
    if callable(own):
        tools.extend(own())
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"the env's tools have repeated names: {names}")
    return tools


def format_tool_results(results: Sequence[str]) -> str:
    """The observation for a turn's tool results: the text itself for one call;
    for several, each inside ``<tool_response>...</tool_response>``, in call order."""
    if len(results) == 1:
        return results[0]
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class ToolEnvWrapper(Wrapper):
    """Lets the agent of any rl2gem env call tools before it acts.

    On each step the action is searched for tool calls
    (:func:`rl2gem.tools.parse_tool_calls`: Hermes ``<tool_call>{json}</tool_call>``
    blocks, or fenced JSON). With calls, the tools run (in order; the wrapped
    env is not stepped) and their results come back as one observation with
    ``info["role"] == "tool"``, reward 0. Without calls, the action goes to the
    wrapped env as usual. So a math env becomes "use Python, then answer",
    a game "look things up, then move".

    Bad calls never raise: a malformed call, an unknown tool or arguments that
    break the tool's JSON schema get an ``Error: ...`` text in the observation
    (``info["invalid_action"]`` is set when no call of the turn could run); a
    turn asking for more calls than are left runs none of them, answers
    ``"Tool-call limit reached ..."`` and truncates the episode
    (``info["truncated_reason"] == "max_tool_calls"``). Every call, valid or
    not, counts toward ``max_tool_calls``, so episodes stay bounded.

    Wrapping an env that already has a :class:`ToolEnvWrapper` (``rl2/PythonMath-v0``'s Python,
    say) adds tools to it: this wrapper offers the inner wrapper's tools and its own as one list
    (the inner one's ``prompt`` is turned off, this one's says where the list goes), runs every
    call, the inner tools' with the inner wrapper's episode state, and counts every call against
    its own ``max_tool_calls``.

    The tool list is offered in the first observation (``prompt="append"``,
    after the env's text; ``"prepend"``; or ``None`` to leave it out, e.g.
    when the chat template renders tools itself) and as OpenAI-style schemas in
    ``info["tools"]`` (for ``tokenizer.apply_chat_template(..., tools=...)``).
    ``info`` of each step also carries ``tool_calls`` (name, arguments, error
    per call of that step), ``tool_results`` (the text of each call's result,
    in order: a rollout renders them as one ``role="tool"`` message each) and
    ``num_tool_calls`` (episode total).

    Args:
        env: an rl2gem env (sync or async).
        tools: the tools; names must be unique.
        max_tool_calls: tool calls allowed per episode.
        prompt: where the tool instructions go: ``"append"``, ``"prepend"`` or ``None``.

    Raises:
        ValueError: duplicate tool names (an inner wrapper's included), ``max_tool_calls < 1`` or a
            bad ``prompt``.
        TypeError: an object in ``tools`` is not a :class:`rl2gem.tools.Tool`.
    """

    def __init__(self, env: gym.Env, tools: Sequence[Tool], max_tool_calls: int = 8, *, prompt: str | None = "append"):
        super().__init__(env)
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(
                    f"{t!r} is not a Tool (needs name, description, parameters, instructions and async call)"
                )
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if max_tool_calls < 1:
            raise ValueError(f"max_tool_calls must be >= 1, got {max_tool_calls}")
        if prompt not in ("append", "prepend", None):
            raise ValueError(f"prompt must be 'append', 'prepend' or None, got {prompt!r}")
        inner = self._inner_wrapper()
        if inner is not None:
            repeated = sorted(set(names) & set(inner.offered_tools()))
            if repeated:
                raise ValueError(f"tool names must be unique, and the wrapped env already has {repeated}")
            inner.prompt = None  # the offered list is this wrapper's, the inner tools included
        self.tools = {t.name: t for t in tools}
        self._episode_tools: dict[str, Tool] = dict(self.tools)
        self.max_tool_calls = max_tool_calls
        self.prompt = prompt
        self._num_calls = 0
        self._over = True
        self._started = False
        self._loop: _PrivateLoop | None = None
        self._owns_copies = False  # a deep copy's or pickle's tools: what they open is its own
        self._shares_tools = False  # spawn's envs and shallow copies: the tools are another wrapper's

    def _inner_wrapper(self) -> ToolEnvWrapper | None:
        """The nearest :class:`ToolEnvWrapper` in the wrapped chain, if any."""
        layer = self.env
        while isinstance(layer, gym.Wrapper):
            if isinstance(layer, ToolEnvWrapper):
                return layer
            layer = layer.env
        return None

    def offered_tools(self) -> dict[str, Tool]:
        """Name -> tool for every tool the agent is offered: inner wrappers' first, then this one's."""
        inner = self._inner_wrapper()
        return {**(inner.offered_tools() if inner is not None else {}), **self.tools}

    def _callable_tools(self) -> dict[str, Tool]:
        """This episode's tools by name (per-episode copies: each wrapper's own)."""
        inner = self._inner_wrapper()
        return {**(inner._callable_tools() if inner is not None else {}), **self._episode_tools}

    # ----------------------------------------------------------------- reset
    def _on_reset(self, obs: str, info: dict[str, Any]) -> ResetResult:
        self._num_calls, self._over, self._started, self._turn, self._num_invalid = 0, False, True, 0, 0
        self._end_episode_tools()
        self._episode_tools = {name: _for_episode(tool) for name, tool in self.tools.items()}
        return fit_observation(self._with_tools(obs), self.observation_space), self._reset_info(info)

    def _end_episode_tools(self) -> None:
        """Close what :func:`_for_episode` made for the episode that ends (e.g. a Python session)."""
        for name, tool in self._episode_tools.items():
            if tool is not self.tools.get(name):
                tool.close()  # type: ignore[attr-defined]
        self._episode_tools = dict(self.tools)

    def _with_tools(self, obs: str) -> str:
        offered = list(self.offered_tools().values())
        if self.prompt is None or not offered:
            return obs
        text = tools_prompt(offered)
        return f"{obs}\n\n{text}" if self.prompt == "append" else f"{text}\n\n{obs}"

    def _reset_info(self, info: dict[str, Any]) -> dict[str, Any]:
        info = dict(info)
        info["tools"] = [tool_schema(t) for t in self.offered_tools().values()]
        info["num_tool_calls"] = 0
        return info

    # ------------------------------------------------------------------ step
    def step(self, action: str) -> StepResult:
        if self._loop is None:
            self._loop = _PrivateLoop(self)
        return self._loop.run(self.astep(action))

    async def astep(self, action: str) -> StepResult:
        if not self._started:
            raise ResetNeeded("Cannot call step() before reset()")
        if self._over:
            raise ResetNeeded("The episode has ended (terminated or truncated): call reset() first")
        calls = parse_tool_calls(action) if isinstance(action, str) else []
        self._turn += 1
        if not calls:
            obs, reward, terminated, truncated, info = await self.inner_astep(action)
            info = dict(info)
            info.update(tool_calls=[], num_tool_calls=self._num_calls, turn=self._turn)
            if "reward_components" in info:  # the wrapped env's parts, and the tool calls it took
                info["reward_components"] = {**info["reward_components"], "tool_calls": float(self._num_calls)}
            info["num_invalid_actions"] = info.get("num_invalid_actions", 0) + self._num_invalid
            self._over = bool(terminated or truncated)
            if self._over:
                self._end_episode_tools()
            return obs, reward, terminated, truncated, info
        left = self.max_tool_calls - self._num_calls
        calls_info = [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in calls]
        if len(calls) > left:
            self._over = True
            self._end_episode_tools()
            self._num_calls = self.max_tool_calls
            obs = (
                f"Tool-call limit reached: this episode allows {self.max_tool_calls} tool calls and "
                f"{left} were left, so none of the {len(calls)} requested was run."
            )
            info = {
                "role": "tool",
                "tool_calls": calls_info,
                "num_tool_calls": self._num_calls,
                "truncated_reason": "max_tool_calls",
                "reward_components": {"tool_calls": float(self._num_calls)},
                "invalid_action": None,
                "turn": self._turn,
                "num_invalid_actions": self._num_invalid,
            }
            return obs, 0.0, False, True, info
        self._num_calls += len(calls)
        results = await run_tool_calls(self._callable_tools(), calls)
        for ci, (_, err) in zip(calls_info, results, strict=True):
            ci["error"] = err
        failed = [err for _, err in results if err is not None]
        self._num_invalid += len(failed) == len(results)
        info = {
            "role": "tool",
            "tool_calls": calls_info,
            "num_tool_calls": self._num_calls,
            "invalid_action": f"invalid tool call: {failed[0]}" if len(failed) == len(results) else None,
            "turn": self._turn,
            "num_invalid_actions": self._num_invalid,
            "tool_results": fit_tool_results([text for text, _ in results], self.observation_space),
        }
        return (
            fit_observation(format_tool_results(info["tool_results"]), self.observation_space),
            0.0,
            False,
            False,
            info,
        )

    # ----------------------------------------------------------------- other
    def spawn(self, n: int):
        """``n`` copies of the current episode's initial state, each wrapped with the same tools."""
        envs, observations, infos = self.env.spawn(n)  # type: ignore[attr-defined]
        wrapped = [ToolEnvWrapper(e, list(self.tools.values()), self.max_tool_calls, prompt=self.prompt) for e in envs]
        for child in wrapped:  # the tools stay this wrapper's: closing a child leaves them open
            child._shares_tools = True
        results = [w._on_reset(o, i) for w, o, i in zip(wrapped, observations, infos, strict=True)]
        return wrapped, [obs for obs, _ in results], [info for _, info in results]

    @property
    def is_async_native(self) -> bool:
        return True

    async def _aclose_tools(self) -> None:
        self._end_episode_tools()
        if self._shares_tools:  # only what the tools opened on this wrapper's own event loop
            closers = ("aclose_loop",)
        else:  # a copied wrapper's tools are copies only it holds: what they opened goes too
            closers = ("aclose", "aclose_copy") if self._owns_copies else ("aclose",)
        for tool in self.tools.values():
            for name in closers:
                closer = getattr(tool, name, None)
                if closer is not None:
                    await closer()

    def close(self) -> None:
        """Close the wrapped env and the tools that have an ``aclose`` (safe to call twice); an env
        made by :meth:`spawn`, or a shallow copy, closes its own env only: the tools stay open for
        the wrapper they came from."""
        self._end_episode_tools()
        if self._loop is not None:
            loop, self._loop = self._loop, None
            try:
                loop.run(self._aclose_tools())
                loop.run(self.env.aclose())  # type: ignore[attr-defined]
            finally:
                loop.stop()
        else:
            if any(hasattr(t, "aclose") for t in self.tools.values()):
                loop = _PrivateLoop(None)
                try:
                    loop.run(self._aclose_tools())
                finally:
                    loop.stop()
            self.env.close()

    async def aclose(self) -> None:
        await self._aclose_tools()
        await self.env.aclose()  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        """Without the private event loop: a copy starts its own (see :mod:`rl2gem.core`, "Copies";
        ``copy.copy`` shares the wrapped env and the tools, as for any gymnasium wrapper)."""
        return {**self.__dict__, "_loop": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A deep copy or an unpickled wrapper: its tools are copies of its own, so closing it
        releases what they opened (a copied MCP connection: ``aclose_copy``); the envs its
        :meth:`spawn` makes share them and release nothing."""
        self.__dict__.update(state, _owns_copies=True, _shares_tools=False)

    def __copy__(self) -> ToolEnvWrapper:
        """A shallow copy: the same wrapped env and tools, owned by the original (no
        :meth:`__setstate__`)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__getstate__(), _shares_tools=True)
        return twin
