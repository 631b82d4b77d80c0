"""Token-in/token-out (TITO) episodes with prefix merging.

A multi-turn episode is kept as token ids from start to end:

* the prompt is the chat template's rendering of the first messages;
* each action is appended exactly as the engine sampled it (never decoded and
  re-tokenised), with action mask 1, its rollout log-probabilities and the
  policy version that produced it;
* each env reply is rendered with the chat template as the *delta* after the
  previous render (the end-of-turn text the template closes the action with,
  then the reply's turn and the next generation prompt) and appended with
  action mask 0.

Prefix merging: while "state + action" is a prefix of the next state's render,
the whole episode stays ONE sequence, so the trainer processes every token
once. A template that is not append-only (one that strips earlier ``<think>``
blocks, say) breaks that property; the episode then starts a new sequence at
that turn (the full render of the conversation so far as the prompt) and the
split is counted in :attr:`Episode.splits`.

How the delta is found: with ``prev`` the messages before the action and
``A = render(prev + [assistant: text])``, ``B = render(prev + [assistant: text,
reply], add_generation_prompt=True)``; the turn merges when ``B`` starts with
``A`` and ``A`` equals ``render(prev, add_generation_prompt=True)`` + text +
closing. The closing text (``"<|im_end|>\\n"`` for ChatML) is found with a
sentinel content, so templates that trim the content still merge; when the
action already ends with the stop token that begins the closing text, only the
rest is appended.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ChatRenderer", "Sequence", "Episode", "TurnDelta"]

_SENTINEL = "\u2063RL2GEM\u2063SENTINEL\u2063"


@dataclasses.dataclass
class Sequence:
    """One training sequence of an episode (all lists have the same length).

    Attributes:
        input_ids: token ids (prompt, actions, env replies).
        action_mask: 1 on tokens the policy generated, 0 elsewhere.
        logprobs: rollout log-probability of each action token (0.0 elsewhere).
        versions: policy (weight) version that produced each action token (-1 elsewhere).
        rewards: the reward of each turn on the last token of its action (0.0 elsewhere).
    """

    input_ids: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    def extend_context(self, ids: list[int]) -> None:
        """Append prompt / env tokens (mask 0)."""
        n = len(ids)
        self.input_ids += ids
        self.action_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.rewards += [0.0] * n

    def extend_action(self, ids: list[int], logprobs: list[float], version: int | list[int]) -> None:
        """Append generated tokens (mask 1)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} action ids but {len(logprobs)} logprobs")
        n = len(ids)
        self.input_ids += ids
        self.action_mask += [1] * n
        self.logprobs += [float(x) for x in logprobs]
        self.versions += list(version) if isinstance(version, list) else [int(version)] * n
        self.rewards += [0.0] * n

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)


@dataclasses.dataclass
class Episode:
    """A finished (or in-progress) multi-turn episode.

    Attributes:
        sequences: the training sequences (one unless the template forced a split).
        group: index of the GRPO group (episodes with the same initial state).
        turns: actions taken.
        turn_rewards: env reward of each turn.
        finish_reasons: the engine's finish reason type of each action.
        terminated / truncated: how the episode ended (truncated also on the
            token budget, ``info["truncated_reason"] == "max_length"``).
        info: the env's last info.
        splits: how many times the chat template forced a new sequence.
        messages: the conversation as text (for logs; the tokens are the truth).
        sampling_seed: base of the per-request ``sampling_seed`` of its actions
            (None: the engine's own generator).
    """

    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    group: int = -1
    turns: int = 0
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    splits: int = 0
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    aborts: int = 0
    sampling_seed: int | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def versions(self) -> list[int]:
        return [v for s in self.sequences for v in s.versions if v >= 0]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def num_action_tokens(self) -> int:
        return sum(s.num_action_tokens for s in self.sequences)


@dataclasses.dataclass
class TurnDelta:
    """What to append after an action: ``ids`` (mask 0), or a new sequence when ``split``."""

    ids: list[int]
    split: bool
    reason: str = ""


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template and computes TITO deltas.

    Args:
        tokenizer: a transformers tokenizer with a chat template (or pass ``chat_template``).
        chat_template: a Jinja template overriding the tokenizer's.
        system_prompt: prepended as a system message when given.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        self.system_prompt = system_prompt

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.chat_template
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def initial_messages(self, observation: str, role: str = "user") -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": role, "content": observation}]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def delta(
        self,
        prev: list[dict[str, str]],
        action_text: str,
        replies: list[dict[str, str]],
        stop_token: int | None,
    ) -> TurnDelta:
        """The tokens that follow an action (see module docstring).

        Args:
            prev: messages before the action.
            action_text: the action decoded (for rendering only).
            replies: the env's new messages.
            stop_token: the action's last token if it was a stop token, else None.
        """
        asst = {"role": "assistant", "content": action_text}
        nxt = prev + [asst] + replies
        full = self.render(nxt, add_generation_prompt=True)
        gen = self.render(prev, add_generation_prompt=True)
        with_sentinel = self.render(prev + [{"role": "assistant", "content": _SENTINEL}])
        head = gen + _SENTINEL
        if not with_sentinel.startswith(head):
            return TurnDelta(self.encode(full), True, "assistant turn does not extend the generation prompt")
        closing = with_sentinel[len(head):]
        a = self.render(prev + [asst])
        if not full.startswith(a):
            return TurnDelta(self.encode(full), True, "template rewrites earlier turns")
        if stop_token is not None:
            stop_text = self.tokenizer.decode([stop_token], skip_special_tokens=False)
            if stop_text and closing.startswith(stop_text):
                closing = closing[len(stop_text):]
        return TurnDelta(self.encode(closing + full[len(a):]), False)
