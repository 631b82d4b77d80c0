"""Wrappers for rl2gem text envs."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from rl2gem.core import ResetResult, StepResult, Wrapper

__all__ = ["ChatHistory"]


class ChatHistory(Wrapper, gym.utils.RecordConstructorArgs):
    """Keeps the whole conversation as a chat message list.

    Envs return only the new text of each turn; evaluation code that wants the
    full conversation (to call a chat API, or to log it) wraps the env::

        env = ChatHistory(gym.make("rl2/GuessTheNumber-v0"), system_prompt="Be brief.")
        obs, info = env.reset(seed=0)
        env.messages  # [{"role": "system", ...}, {"role": "user", "content": obs}]

    After each ``step(action)`` the list gains ``{"role": "assistant",
    "content": action}`` and, when the env replied, ``{"role": info["role"],
    "content": obs}``. ``info["messages"]`` holds a copy when
    ``include_in_info=True``. ``gym.make(env.spec)`` builds the wrapped env again, this wrapper
    included (its arguments are in the spec).

    Args:
        env: the env to wrap.
        system_prompt: optional first ``system`` message.
        include_in_info: also return a copy of the list in ``info["messages"]``.
    """

    def __init__(self, env: gym.Env, system_prompt: str | None = None, include_in_info: bool = True):
        gym.utils.RecordConstructorArgs.__init__(self, system_prompt=system_prompt, include_in_info=include_in_info)
        super().__init__(env)
        self.system_prompt = system_prompt
        self.include_in_info = include_in_info
        self.messages: list[dict[str, str]] = []

    def _on_reset(self, obs: str, info: dict[str, Any]) -> ResetResult:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages.append({"role": info.get("role", "user"), "content": obs})
        return obs, self._with_messages(info)

    def _on_step(self, action: Any, result: StepResult) -> StepResult:
        obs, reward, terminated, truncated, info = result
        content = action if isinstance(action, str) else repr(action)
        self.messages.append({"role": "assistant", "content": content})
        if obs:
            self.messages.append({"role": info.get("role", "user"), "content": obs})
        return obs, reward, terminated, truncated, self._with_messages(info)

    def _with_messages(self, info: dict[str, Any]) -> dict[str, Any]:
        if self.include_in_info:
            info = dict(info)
            info["messages"] = [dict(m) for m in self.messages]
        return info

    def step(self, action: str) -> StepResult:
        return self._on_step(action, self.env.step(action))

    async def astep(self, action: str) -> StepResult:
        return self._on_step(action, await self.inner_astep(action))
