"""The wire format of an rl2gem env served over HTTP or WebSocket (OpenEnv's contract).

OpenEnv (meta-pytorch/OpenEnv, ``openenv-core`` 0.2) serves one environment per server and
answers ``/reset`` and ``/step`` with an *envelope*::

    {"observation": {...env fields...}, "reward": float | null, "done": bool}

An rl2gem text env's envelope carries, in ``observation``: ``message`` (the observation text: the
env's reply this turn, a delta), ``terminated`` and ``truncated`` (Gymnasium's two flags, which
``done`` joins) and ``info`` (the step's info, made JSON-safe). The action is ``{"message": str}``,
the field name of OpenEnv's text envs (TextArena). :mod:`rl2gem.serving.env_server` writes these,
:class:`rl2gem.remote.RemoteEnv` reads them, and :func:`env_schema` describes them at
``/schema``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from rl2gem.registry import find_spec

__all__ = [
    "ACTION_FIELD",
    "ProtocolError",
    "env_schema",
    "json_safe",
    "read_reset",
    "read_step",
    "reset_envelope",
    "step_envelope",
]

#: The field of an action object that holds the agent's text.
ACTION_FIELD = "message"


class ProtocolError(ValueError):
    """A message that does not follow the wire format (a client's bad request, or a server's bad reply)."""


def json_safe(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python numbers and lists, tuples and sets as lists,
    mapping keys as strings, non-finite floats as ``None`` and any other object as its ``str``: what
    :func:`json.dumps` writes without error."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(item) for item in value]
    return str(value)


def reset_envelope(observation: str, info: Mapping[str, Any]) -> dict[str, Any]:
    """The envelope of ``reset``'s ``(observation, info)``."""
    return step_envelope(observation, None, False, False, info)


def step_envelope(
    observation: str, reward: float | None, terminated: bool, truncated: bool, info: Mapping[str, Any]
) -> dict[str, Any]:
    """The envelope of ``step``'s ``(observation, reward, terminated, truncated, info)``."""
    return {
        "observation": {
            ACTION_FIELD: observation,
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "info": json_safe(dict(info)),
        },
        "reward": None if reward is None else float(reward),
        "done": bool(terminated or truncated),
    }


def _observation(envelope: Any) -> dict[str, Any]:
    if not isinstance(envelope, Mapping) or not isinstance(envelope.get("observation"), Mapping):
        raise ProtocolError(f"expected an envelope {{observation, reward, done}}, got {envelope!r:.200}")
    observation = envelope["observation"]
    if not isinstance(observation.get(ACTION_FIELD), str):
        raise ProtocolError(f"the observation has no text field {ACTION_FIELD!r}: {observation!r:.200}")
    return observation


def read_reset(envelope: Any) -> tuple[str, dict[str, Any]]:
    """``(observation, info)`` of a reset envelope.

    Raises:
        ProtocolError: not an envelope of this format.
    """
    observation = _observation(envelope)
    return observation[ACTION_FIELD], dict(observation.get("info") or {})


def read_step(envelope: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """``(observation, reward, terminated, truncated, info)`` of a step envelope (an envelope
    without the two flags, as other OpenEnv servers send, reads ``done`` as ``terminated``).

    Raises:
        ProtocolError: not an envelope of this format.
    """
    observation = _observation(envelope)
    done = bool(envelope.get("done", False))
    terminated = bool(observation.get("terminated", done))
    truncated = bool(observation.get("truncated", False))
    reward = envelope.get("reward")
    return observation[ACTION_FIELD], float(reward or 0.0), terminated, truncated, dict(observation.get("info") or {})


def _text_schema(space: gym.Space, description: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "description": description}
    if getattr(space, "max_length", None) is not None:
        schema["maxLength"] = int(space.max_length)
    return schema


def _constructor_kwargs(env_id: str) -> dict[str, Any]:
    """The keyword arguments of ``env_id``'s entry point: name -> ``{"default": ..., "registered": ...}``."""
    spec = find_spec(env_id)
    entry = spec.entry_point
    creator = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
    kwargs = {}
    for name, parameter in inspect.signature(creator).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or name == "self":
            continue
        default = None if parameter.default is inspect.Parameter.empty else json_safe(parameter.default)
        kwargs[name] = {"default": default, "required": parameter.default is inspect.Parameter.empty}
    for name, value in (spec.kwargs or {}).items():
        kwargs.setdefault(name, {"default": None, "required": False})["registered"] = json_safe(value)
    return kwargs


def env_schema(env_id: str, env: gym.Env, env_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What ``GET /schema`` answers: JSON Schemas of the action, the observation and the state
    (OpenEnv's three), then rl2gem's: the env's constructor ``kwargs`` (defaults, and the values
    this server made it with under ``served``), the rules a client needs to act as the local
    env does (``invalid_action_reward``, ``invalid_action_terminates``, ``max_turns``) and
    ``num_items``, the size of its data set (``len(env)``; None for an env without one)."""
    action = _text_schema(env.action_space, "the agent's text for this turn")
    observation = _text_schema(env.observation_space, "the env's reply this turn (a delta, not the history)")
    return {
        "action": {"type": "object", "properties": {ACTION_FIELD: action}, "required": [ACTION_FIELD]},
        "observation": {
            "type": "object",
            "properties": {
                ACTION_FIELD: observation,
                "terminated": {"type": "boolean"},
                "truncated": {"type": "boolean"},
                "info": {"type": "object", "description": "the step's info (role, turn, seed, tools, ...)"},
            },
            "required": [ACTION_FIELD, "terminated", "truncated", "info"],
        },
        "state": {
            "type": "object",
            "properties": {
                "episode_id": {"type": ["string", "null"]},
                "step_count": {"type": "integer", "minimum": 0},
                "seed": {"type": ["integer", "null"]},
                "done": {"type": "boolean"},
            },
        },
        "env_id": env_id,
        "kwargs": _constructor_kwargs(env_id),
        "served": json_safe(dict(env_kwargs)),
        "invalid_action_reward": float(getattr(env.unwrapped, "invalid_action_reward", 0.0)),
        "invalid_action_terminates": bool(getattr(env.unwrapped, "invalid_action_terminates", False)),
        "max_turns": getattr(env.unwrapped, "max_turns", None),
        "num_items": dataset_size(env),
    }


def dataset_size(env: gym.Env) -> int | None:
    """How many items ``env``'s data set holds (``len(env.unwrapped)``), or None without one."""
    try:
        return len(env.unwrapped)
    except TypeError:  # no __len__, or one that says there is no data set (rl2/Remote-v0)
        return None
