"""rl2gem envs inside TRL's ``GRPOTrainer``: a data set, reward functions and an environment
factory made from any registered env id.

Single-turn tasks (math, QA answered at once)::

    from trl import GRPOConfig, GRPOTrainer
    from rl2gem.integrations.trl import env_dataset, env_reward

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=env_reward("rl2/GSM8K-v0"),
        train_dataset=env_dataset("rl2/GSM8K-v0", n=1000, split="train"),
        args=GRPOConfig(...),
    )

Each row of :func:`env_dataset` is one task: ``prompt`` (the env's first observation as a user
message) and ``rl2gem_seed`` / ``rl2gem_index`` (how to reset the env to it). :func:`env_reward`
resets an env to the row's task, plays the completion as the action and returns the env's reward,
so TRL scores completions with the env's own checker (math-verify, EM, the game's rules).

Multi-turn envs (search, games): add ``environment_factory=env_factory("rl2/SearchQA-v0")``.
Each rollout then gets its own :class:`EnvironmentTool`, whose ``act(action)`` method TRL offers
the model as a tool (TRL's ``environment_factory`` contract, TRL >= 1.0 with transformers >= 5.2,
a chat template TRL can parse tool calls for, e.g. Qwen3's): every call is one env step and
returns the env's reply. A tool env (one under :class:`rl2gem.tools.ToolEnvWrapper`, such as
``rl2/PythonMath-v0``) also gets one method per tool it offers, named and described as the tool:
TRL parses the model's call and the method plays it as the env's action (a ``<tool_call>``
block), one env step, so the env counts and scores it. When the model stops calling tools,
:func:`env_reward` (given the rollout's environments by TRL) plays its final message as the last
action if the episode is still running, and returns the episode's total reward.

Nothing here imports TRL: the objects are what its ``GRPOTrainer`` takes, so any TRL version
with the same contract works.
"""

from __future__ import annotations

import inspect
import json
import threading
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym

import rl2gem
from rl2gem.tools import ToolEnvWrapper
from rl2gem.tools.base import hermes_tool_calls

__all__ = ["env_dataset", "env_reward", "env_factory", "EnvironmentTool"]


def _kwargs(env_id: str, split: str | None, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    from rl2gem.registry import standard_kwargs

    return standard_kwargs(env_id, dict(env_kwargs), split=split)


def env_dataset(env_id: str, n: int, split: str | None = "train", seed: int = 0, **env_kwargs):
    """The first ``n`` tasks of an env as a ``datasets.Dataset`` for TRL.

    An env with a data set gives its items in order (at most ``len(env)``), others the seeds
    ``seed, seed + 1, ...`` (as :func:`rl2gem.evaluation.task_resets`).

    Returns:
        a ``datasets.Dataset`` with columns ``prompt`` (``[{"role", "content"}]``, the first
        observation), ``rl2gem_seed`` (int) and ``rl2gem_index`` (int, -1 for envs without a data set).
    """
    from datasets import Dataset

    from rl2gem.evaluation import task_resets

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"env_dataset needs n >= 1 tasks, got {n!r}")
    kwargs = _kwargs(env_id, split, env_kwargs)
    if split not in (None, "train") and "split" not in kwargs:
        warnings.warn(
            f"{env_id} has no data split: split={split!r} changes nothing, and its tasks are the seeds "
            f"{seed}, {seed + 1}, ...; hold tasks out with other seeds (e.g. seed=100000), not another split",
            stacklevel=2,
        )
    env = rl2gem.make(env_id, **kwargs)
    rows = []
    try:
        for task_seed, options in task_resets(env_id, kwargs, n, seed):
            obs, info = env.reset(seed=task_seed, options=options)
            rows.append(
                {
                    "prompt": [{"role": info.get("role", "user"), "content": obs}],
                    "rl2gem_seed": int(task_seed),
                    "rl2gem_index": int((options or {}).get("index", -1)),
                }
            )
    finally:
        env.close()
    return Dataset.from_list(rows)


def _reset(env, rl2gem_seed: int, rl2gem_index: int, prompt: Any = None):
    """Reset ``env`` to a row's task; with the row's ``prompt``, check that one of its messages
    holds that task's first observation (instructions added around it are fine).

    Raises:
        ValueError: the prompt is another task's: the data set was made with another split or
            other env kwargs than this env (its rows' indexes and seeds name other tasks here).
    """
    options = {"index": int(rl2gem_index)} if rl2gem_index is not None and int(rl2gem_index) >= 0 else None
    observation, info = env.reset(seed=int(rl2gem_seed), options=options)
    if prompt is not None and not any(observation in text for text in _prompt_texts(prompt)):
        raise ValueError(
            f"the row (rl2gem_seed={rl2gem_seed}, rl2gem_index={rl2gem_index}) resets {env.spec.id if env.spec else env} "
            "to another task than its prompt: give env_reward / env_factory the split and env kwargs the data set "
            "was made with (env_dataset's)"
        )
    return observation, info


def _prompt_texts(prompt: Any) -> list[str]:
    """The texts of a row's prompt: its messages' contents (conversational), or the text itself."""
    if isinstance(prompt, str):
        return [prompt]
    texts = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        texts.append(content or "")
    return texts


class EnvironmentTool:
    """One rl2gem env as an environment of TRL's ``environment_factory``: ``reset(**row)`` puts
    the env on the row's task; the model plays it through the ``act`` tool.

    Attributes:
        env: the rl2gem env (made once, reset for each rollout).
        total_reward: the episode's reward so far (float).
        done: whether the episode ended (terminated or truncated).
        info: the last step's (or the reset's) info.
    """

    def __init__(self, env_id: str, split: str | None = "train", **env_kwargs):
        self.env = rl2gem.make(env_id, **_kwargs(env_id, split, env_kwargs))
        self.total_reward, self.done, self.info = 0.0, False, {}

    def reset(self, rl2gem_seed: int = 0, rl2gem_index: int = -1, **row) -> None:
        """Start the row's task (the prompt already holds its first observation: nothing is added).

        Raises:
            ValueError: the row's prompt is not that task's (another split or env kwargs).
        """
        _, self.info = _reset(self.env, rl2gem_seed, rl2gem_index, row.get("prompt"))
        self.total_reward, self.done = 0.0, False

    def _close(self) -> None:
        """Close the env (its sessions, sandboxes). Private: TRL offers every public method as a
        tool."""
        self.env.close()

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Play a call of the env's tool ``name`` as its action (a ``<tool_call>`` block, as the
        model would write it): one env step; returns the env's reply."""
        call = {"function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        return self.act(hermes_tool_calls([call]))

    def act(self, action: str) -> str:
        """Take one turn in the environment: send your action, written in the format the task asks
        for, and get the environment's reply.

        Args:
            action: the full text of your move, for example a search request or a guess.

        Returns:
            The environment's reply; it says when the episode is over.
        """
        if self.done:
            return "The episode is over; no further actions are taken."
        obs, reward, terminated, truncated, self.info = self.env.step(action)
        self.total_reward += float(reward)
        self.done = bool(terminated or truncated)
        return obs + ("\n(The episode is over.)" if self.done else "")

    def _finish(self, final_message: str) -> float:
        """Play the model's final message as the last action if the episode is still running;
        returns the episode's total reward. (Private: TRL offers every public method as a tool.)"""
        if not self.done and final_message.strip():
            self.act(final_message)
        return self.total_reward


def env_factory(env_id: str, split: str | None = "train", **env_kwargs) -> Callable[[], EnvironmentTool]:
    """A zero-argument factory of :class:`EnvironmentTool` for ``GRPOTrainer(environment_factory=...)``.

    For a tool env, the instances are of a subclass with one method per offered tool (made from
    the first instance's env): TRL builds each tool's schema from the method's name, signature
    and docstring, which come from the tool's JSON schema.
    """
    kind: list[type[EnvironmentTool]] = []

    def make() -> EnvironmentTool:
        if kind:
            return kind[0](env_id, split, **env_kwargs)
        first = EnvironmentTool(env_id, split, **env_kwargs)
        kind.append(_with_tool_methods(first.env))
        first.__class__ = kind[0]
        return first

    return make


#: JSON schema types -> the Python annotations transformers' ``get_json_schema`` turns back into them.
_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def _with_tool_methods(env: gym.Env) -> type[EnvironmentTool]:
    """:class:`EnvironmentTool`, or for an env under a :class:`~rl2gem.tools.ToolEnvWrapper` a
    subclass with a method per tool the outermost one offers (one whose name is not a public
    method of :class:`EnvironmentTool` already and does not start with ``_``).

    Raises:
        ValueError: a tool whose parameters are not an ``object`` schema with ``properties``.
    """
    layer = env
    while isinstance(layer, gym.Wrapper) and not isinstance(layer, ToolEnvWrapper):
        layer = layer.env
    if not isinstance(layer, ToolEnvWrapper):
        return EnvironmentTool
    methods = {}
    for name, tool in layer.offered_tools().items():
        if name.startswith("_") or hasattr(EnvironmentTool, name):
            continue
        methods[name] = _tool_method(name, tool.description, tool.parameters)
    return type(f"{type(env.unwrapped).__name__}Tools", (EnvironmentTool,), methods) if methods else EnvironmentTool


def _tool_method(name: str, description: str, parameters: dict[str, Any]) -> Callable[..., str]:
    """A method ``name(self, **arguments) -> str`` that calls the env's tool, with the signature,
    annotations and Google-style docstring of the tool's JSON schema."""
    properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        raise ValueError(f"tool {name!r}: its parameters are not an object schema with properties")
    required = set(parameters.get("required", []))

    def call(self: EnvironmentTool, **arguments: Any) -> str:
        return self._call_tool(name, {k: v for k, v in arguments.items() if v is not None or k in required})

    annotations: dict[str, Any] = {}
    signature = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    lines = [(description or f"Call the {name} tool.").strip(), "", "Args:"]
    for key, schema in properties.items():
        kind = _JSON_TYPES.get(schema.get("type") if isinstance(schema, dict) else None, str)
        optional = key not in required
        annotations[key] = kind | None if optional else kind
        default = None if optional else inspect.Parameter.empty
        signature.append(
            inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[key])
        )
        text = (schema.get("description") if isinstance(schema, dict) else None) or key
        lines.append(f"    {key}: {' '.join(str(text).split())}")
    lines += ["", "Returns:", "    The environment's reply with the tool's result."]
    call.__name__ = call.__qualname__ = name
    call.__doc__ = "\n".join(lines if properties else lines[:1] + lines[-3:])
    call.__annotations__ = {**annotations, "return": str}
    call.__signature__ = inspect.Signature(signature, return_annotation=str)  # type: ignore[attr-defined]
    return call


def _final_text(completion: Any) -> str:
    """The final message of a completion (conversational: a list of messages; else the text), ""
    when the completion ends on a tool call or a tool's reply: TRL's tool loop stopped (its
    iteration or length limit) before the model wrote a final answer, so nothing is played."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return ""
    return _prompt_texts([last])[0]


def _log_parts(
    log_metric: Callable[[str, float], None] | None, prefix: str, infos: list[dict], rewards: list[float]
) -> None:
    """Log through TRL's ``log_metric`` the mean of each reward component of the episodes' last
    ``infos`` (over those that report it) and their share of successes (``info["success"]``,
    else a reward above 0, as evaluation counts them)."""
    if log_metric is None:
        return
    parts: dict[str, list[float]] = {}
    for info in infos:
        for name, value in dict(info.get("reward_components") or {}).items():
            parts.setdefault(name, []).append(float(value))
    parts["success"] = [float(bool(i.get("success", r > 0))) for i, r in zip(infos, rewards, strict=True)]
    for name, values in sorted(parts.items()):
        if values:
            log_metric(f"{prefix}/{name}", sum(values) / len(values))


def env_reward(env_id: str, split: str | None = "train", **env_kwargs) -> Callable[..., list[float]]:
    """A reward function for ``GRPOTrainer(reward_funcs=...)`` scored by the env itself.

    Called by TRL as ``f(prompts=..., completions=..., rl2gem_seed=[...], rl2gem_index=[...],
    environments=[...] (with an environment factory), **other_columns)``. With ``environments``
    each rollout's :class:`EnvironmentTool` finishes its episode with the final message; without,
    an env is reset to each row's task and the completion is played as one action.

    Returns:
        a function returning one float per completion, named ``rl2gem/<env>`` in TRL's logs;
        its ``close()`` closes the env it scores with. It is thread-safe (one episode at a time).
        Given TRL's ``log_metric``, it also logs the batch's mean of each of the env's reward
        components (``rl2gem/<env>/<component>``, over the episodes that report it) and the
        share of successes (``rl2gem/<env>/success``), as a verifiers rubric's parts are logged.

    Raises:
        KeyError: the data set lacks ``rl2gem_seed`` (make it with :func:`env_dataset`).
        ValueError: a row's prompt is not the task its seed and index reset to here: the data
            set was made with another split or env kwargs (checked against TRL's ``prompts``).
    """
    scorer: list[Any] = []  # one env, made on first use and reused
    lock = threading.Lock()  # one episode at a time on it (a caller may score from several threads)

    def reward(
        completions, prompts=None, rl2gem_seed=None, rl2gem_index=None, environments=None, log_metric=None, **_
    ) -> list[float]:
        texts = [_final_text(c) for c in completions]
        if environments is not None:
            out = [float(e._finish(t)) for e, t in zip(environments, texts, strict=True)]
            _log_parts(log_metric, reward.__name__, [e.info for e in environments], out)
            return out
        if rl2gem_seed is None:
            raise KeyError("the data set has no rl2gem_seed column; build it with rl2gem.integrations.trl.env_dataset")
        indexes = rl2gem_index if rl2gem_index is not None else [-1] * len(texts)
        rows = prompts if prompts is not None else [None] * len(texts)
        out, infos = [], []
        with lock:
            if not scorer:
                scorer.append(rl2gem.make(env_id, **_kwargs(env_id, split, env_kwargs)))
            for text, task_seed, index, prompt in zip(texts, rl2gem_seed, indexes, rows, strict=True):
                _reset(scorer[0], task_seed, index, prompt)
                _, value, *_, info = scorer[0].step(text)
                out.append(float(value))
                infos.append(info)
        _log_parts(log_metric, reward.__name__, infos, out)
        return out

    def close() -> None:
        """Close the scoring env (its sessions, sandboxes), if one was made."""
        with lock:
            while scorer:
                scorer.pop().close()

    reward.__name__ = f"rl2gem/{env_id.split('/')[-1]}"
    reward.close = close  # type: ignore[attr-defined]
    return reward
