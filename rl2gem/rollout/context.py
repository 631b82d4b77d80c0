"""Managed context: what a multi-turn episode's next segment starts from when its history no
longer fits ``context.max_tokens``.

An episode's conversation is split into *segments*, one training sequence each. Within a
segment the sequence grows turn by turn, token in and token out, as always. When the next turn
would not fit (the sequence, the env's reply and ``max_new_tokens`` over ``max_tokens``), the
rollout starts a new segment from a shorter conversation, chosen by the policy:

* ``truncate``: the task (the system prompt and the env's first observation) and the most
  recent turns that fit (an assistant action and the env's replies to it are kept or dropped
  together; the latest turn is always kept). When the task and the latest turn alone do not fit,
  the latest reply is cut from its end to fit, :data:`CUT_MARKER` appended (Search-R1 cuts each
  retrieval to ``max_obs_length`` tokens the same way); only a task and action too long for an
  empty reply end the episode;
* ``summarize``: the model is asked (:data:`SUMMARY_PROMPT`, a user turn after the env's
  reply) to summarise its progress; the summary is an action of the old segment (trained with
  the episode's credit, like any action; the env never sees it) and the new segment starts from
  the task, the summary as the assistant's turn and :data:`CONTINUE_PROMPT`. The request and the
  summary may take the old segment past ``max_tokens`` (up to the rollout's ``max_length``): the
  model has to read the reply that did not fit to summarise it. Without that room, or when the
  new segment (task, summary, continue prompt) would leave no room for an action within
  ``max_tokens``, the policy falls back to ``truncate`` (the summary stays a trained action of
  the old segment).

Every segment is a training sequence of the episode (:attr:`rl2gem.rollout.tito.Episode.sequences`):
every estimator takes the episode's segments as one row (:func:`rl2gem.training.samples.episode_rows`:
an outcome estimator counts the episode once, returns run across its segments). The tokens of a segment are exactly what the engine was given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["CONTEXT_POLICIES", "CONTINUE_PROMPT", "CUT_MARKER", "SUMMARY_PROMPT", "ContextConfig", "truncated_messages"]

CONTEXT_POLICIES = ("truncate", "summarize")

SUMMARY_PROMPT = (
    "Your context is almost full. Summarise your progress so far in a few sentences: what you "
    "searched or tried, what you found, and what is left to do. Your summary will replace the "
    "conversation after the task. Do not answer yet."
)
CONTINUE_PROMPT = "Continue the task from your summary."
CUT_MARKER = " [...]"  # ends a reply that ``truncate`` cut to fit


@dataclasses.dataclass
class ContextConfig:
    """``rollout.context``: the token budget of one segment and what happens when it is reached.

    Attributes:
        max_tokens: tokens one segment may hold (prompt, actions, replies and the next action's
            ``max_new_tokens``); None (default) lets the conversation grow to ``max_length``.
        policy: ``truncate`` or ``summarize`` (see the module doc).
        summary_max_new_tokens: token budget of a summary.

    Raises:
        ValueError: an unknown policy or a budget below 1.
    """

    max_tokens: int | None = None
    policy: str = "truncate"
    summary_max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.policy not in CONTEXT_POLICIES:
            raise ValueError(f"context.policy must be one of {CONTEXT_POLICIES}, got {self.policy!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"context.max_tokens must be >= 1 or null, got {self.max_tokens}")
        if self.summary_max_new_tokens < 1:
            raise ValueError(f"context.summary_max_new_tokens must be >= 1, got {self.summary_max_new_tokens}")

    @classmethod
    def from_value(cls, value: Any) -> ContextConfig:
        """A :class:`ContextConfig` from itself, a mapping (a config section) or None (defaults).

        Raises:
            ValueError: a key that is not a field, or a bad value.
        """
        if value is None or isinstance(value, cls):
            return value or cls()
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"context: {unknown} are not context settings (fields: {sorted(names)})")
        return cls(**dict(value))

    def fits(self, tokens: int, max_new_tokens: int) -> bool:
        """Whether a segment of ``tokens`` tokens has room for an action of ``max_new_tokens``."""
        return self.max_tokens is None or tokens + max_new_tokens <= self.max_tokens


def truncated_messages(
    messages: list[dict[str, str]], task_length: int, length: Callable[[list[dict[str, str]]], int], budget: int
) -> list[dict[str, str]] | None:
    """The ``truncate`` policy: the first ``task_length`` messages (system prompt and task) and
    the most recent turns whose rendering, ``length(messages)`` tokens, is at most ``budget``; a
    turn is an assistant message and the replies that follow it. When even the task and the last
    turn do not fit, the last turn with its last reply cut (:func:`_cut_last_reply`); None when
    that does not fit either."""
    task, turns = messages[:task_length], []
    for message in messages[task_length:]:
        if message["role"] == "assistant" or not turns:
            turns.append([])
        turns[-1].append(message)
    for start in range(len(turns)):
        kept = task + [message for turn in turns[start:] for message in turn]
        if length(kept) <= budget:
            return kept
    return _cut_last_reply(task + turns[-1], length, budget) if turns else None


def _cut_last_reply(
    messages: list[dict[str, str]], length: Callable[[list[dict[str, str]]], int], budget: int
) -> list[dict[str, str]] | None:
    """``messages`` with the last one's content cut to its longest head that, with
    :data:`CUT_MARKER` appended, keeps ``length(messages)`` within ``budget`` (a binary search over
    the characters kept); None when the last message is the assistant's or an empty head does not
    fit."""
    last = messages[-1]
    if last["role"] == "assistant":
        return None

    def cut(characters: int) -> list[dict[str, str]]:
        return messages[:-1] + [{**last, "content": last["content"][:characters] + CUT_MARKER}]

    if length(cut(0)) > budget:
        return None
    low, high = 0, len(last["content"])  # cut(low) fits
    while low < high:
        middle = (low + high + 1) // 2
        if length(cut(middle)) <= budget:
            low = middle
        else:
            high = middle - 1
    return cut(low)
