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
from pathlib import Path
from typing import Any

import numpy as np

from rl2gem.data import assistant_extra_keys

__all__ = [
    "ChatRenderer",
    "Sequence",
    "Episode",
    "TurnDelta",
    "load_chat_template",
    "BUILTIN_TEMPLATES",
    "common_prefix_length",
]

_SENTINEL = "\u2063RL2GEM\u2063SENTINEL\u2063"


def common_prefix_length(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists or int arrays)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclasses.dataclass
class Sequence:
    """One training sequence of an episode (all lists have the same length).

    Attributes:
        input_ids: token ids (prompt, actions, env replies).
        action_mask: 1 on tokens the policy generated, 0 elsewhere.
        logprobs: rollout log-probability of each action token (0.0 elsewhere).
        versions: policy (weight) version that produced each action token (-1 elsewhere).
        rewards: the reward of each turn on the last token of its action (0.0 elsewhere).
        summary: its last action is the model's summary of its progress (a managed context's,
            ``rollout.context.policy=summarize``), not a turn of the episode.
    """

    input_ids: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    summary: bool = False

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

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (every list cut alike)."""
        for name in ("input_ids", "action_mask", "logprobs", "versions", "rewards"):
            del getattr(self, name)[length:]

    def add_reward(self, value: float) -> None:
        """Add ``value`` to the reward of the last action token (the last token if none), where every
        advantage estimator reads a turn's reward: a turn whose action is empty keeps its reward on
        the previous action rather than on a context token, which the estimators that read action
        tokens only would drop while the outcome ones (GRPO, RLOO) count it."""
        position = next((i for i in range(len(self) - 1, -1, -1) if self.action_mask[i]), len(self) - 1)
        self.rewards[position] += float(value)


@dataclasses.dataclass
class Episode:
    """A finished (or in-progress) multi-turn episode.

    Attributes:
        sequences: the training sequences (one unless the template forced a split).
        group: index of the GRPO group (episodes with the same initial state).
        turns: actions taken.
        turn_rewards: env reward of each turn.
        finish_reasons: the engine's finish reason type of each action (``"length"``: cut off at
            its token limit).
        action_lengths: the tokens generated for each action.
        terminated / truncated: how the episode ended (truncated also on the
            token budget, ``info["truncated_reason"] == "max_length"``).
        info: the env's last info.
        splits: how many times the chat template forced a new sequence.
        segments: how many times a full context started a new sequence (``rollout.context``).
        summaries: how many of those began with the model's summary of its progress.
        messages: the conversation as text (for logs; the tokens are the truth).
        sampling_seed: base of the per-request ``sampling_seed`` of its actions
            (None: the engine's own generator).
    """

    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    group: int = -1
    turns: int = 0
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    action_lengths: list[int] = dataclasses.field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    splits: int = 0
    segments: int = 0
    summaries: int = 0
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


#: Chat templates shipped with rl2gem (``rl2gem/rollout/templates/<name>.jinja``), usable by name.
#: ``chatml_tools``: ChatML (``<|im_start|>role ... <|im_end|>``, SmolLM2's and Qwen's turn
#: format) that also renders ``tools`` (one JSON schema per line in a system turn, the
#: ``<tool_call>`` format) and groups consecutive ``role="tool"`` results into one user turn,
#: each inside ``<tool_response>``: tool support for ChatML models whose own template has none.
BUILTIN_TEMPLATES = ("chatml_tools",)


def load_chat_template(value: str | None) -> str | None:
    """A ``chat_template`` option of the CLIs: ``None``/empty, a built-in name
    (:data:`BUILTIN_TEMPLATES`), a Jinja file's path, or the template text itself.

    Raises:
        FileNotFoundError: ``value`` is none of these.
    """
    if not value:
        return None
    if "{" in value:
        return value
    if value in BUILTIN_TEMPLATES:
        return (Path(__file__).with_name("templates") / f"{value}.jinja").read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"chat_template: {value!r} is not a file, a Jinja template or a built-in name ({', '.join(BUILTIN_TEMPLATES)})"
        )
    return path.read_text(encoding="utf-8")


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template and computes TITO deltas.

    Args:
        tokenizer: a transformers tokenizer with a chat template (or pass ``chat_template``).
        chat_template: a template overriding the tokenizer's: a built-in name (``chatml_tools``...),
            a Jinja file or the Jinja text (:func:`load_chat_template`; a name was taken as the text).
        system_prompt: prepended as a system message when given.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template = load_chat_template(chat_template)
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        self.system_prompt = system_prompt

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` list (renders tool schemas itself).

        A template that never mentions ``tools`` drops them silently, so this is
        checked before tools are handed to it.
        """
        template = self.chat_template or self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one renders conversations
            template = template.get("tool_use") or template.get("default") or ""
        return "tools" in str(template)

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text of ``messages``.

        Args:
            messages: ``{"role", "content"}`` dicts.
            add_generation_prompt: end with the opening of an assistant turn.
            tools: OpenAI-style function schemas (an env's ``info["tools"]``), passed to the
                template as ``tools`` (only when not empty).
        """
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            **kw,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def initial_messages(self, observation: str, role: str = "user") -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": role, "content": observation}]

    def prompt_ids(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` (and ``tools``, see :meth:`render`) followed by the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def delta(
        self,
        prev: list[dict[str, str]],
        action_text: str,
        replies: list[dict[str, str]],
        stop_token: int | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnDelta:
        """The tokens that follow an action (see module docstring).

        Args:
            prev: messages before the action.
            action_text: the action decoded (for rendering only).
            replies: the env's new messages.
            stop_token: the action's last token if it was a stop token, else None.
            tools: the schemas the episode's prompt was rendered with (see :meth:`render`).
        """
        asst = {"role": "assistant", "content": action_text}
        nxt = prev + [asst] + replies
        full = self.render(nxt, add_generation_prompt=True, tools=tools)
        gen = self.render(prev, add_generation_prompt=True, tools=tools)
        self._check_replies_rendered(prev + [asst], replies, full[len(gen) :] if full.startswith(gen) else full, tools)
        if full.startswith(gen + action_text):  # the engine's prompt and the action as the render has them
            return TurnDelta(self.encode(self._after_stop(full[len(gen + action_text) :], stop_token)), False)
        # a template that renders the content otherwise (trims it, or the last assistant turn differently)
        with_sentinel = self.render(prev + [{"role": "assistant", "content": _SENTINEL}], tools=tools)
        head = gen + _SENTINEL
        if not with_sentinel.startswith(head):
            return TurnDelta(self.encode(full), True, "assistant turn does not extend the generation prompt")
        closing = with_sentinel[len(head) :]
        a = self.render(prev + [asst], tools=tools)
        if not full.startswith(a):
            return TurnDelta(self.encode(full), True, "template rewrites earlier turns")
        return TurnDelta(self.encode(self._after_stop(closing, stop_token) + full[len(a) :]), False)

    def _check_replies_rendered(self, before, replies, rendered: str, tools) -> None:
        """Raise when the chat template left out an env reply: the model would act without seeing
        it (a tool result under a template with no ``tool`` role) while the episode's messages
        recorded it. ``rendered``: the render of ``before + replies`` from the action on. A reply
        whose text is not there as written (a template that JSON-encodes or trims it) is rendered
        again with a marker for its text, which must then be there.

        Raises:
            ValueError: naming the role the template does not render.
        """
        missing = [
            i for i, r in enumerate(replies) if (text := str(r.get("content", "")).strip()) and text not in rendered
        ]
        if not missing:
            return
        marked = [dict(r, content=f"RL2GEMREPLY{i}X") if i in missing else r for i, r in enumerate(replies)]
        again = self.render(before + marked, add_generation_prompt=True, tools=tools)
        for i in missing:
            if f"RL2GEMREPLY{i}X" not in again:
                role = replies[i]["role"]
                raise ValueError(
                    f"the chat template does not render the env's {role!r} message: the model would never see it; "
                    f"use a template that renders role {role!r} (rollout.chat_template=chatml_tools renders tool "
                    "results)"
                )

    def _after_stop(self, text: str, stop_token: int | None) -> str:
        """``text`` (what follows an action's content in a render) without the sampled stop
        token's text at its start: the token is the action's last, already in the sequence."""
        if stop_token is not None:
            stop_text = self.tokenizer.decode([stop_token], skip_special_tokens=False)
            if stop_text and text.startswith(stop_text):
                return text[len(stop_text) :]
        return text

    def conversation(
        self,
        messages: list[dict[str, str]],
        tools: list[dict[str, Any]] | None = None,
        stop_token: int | None = None,
    ) -> Sequence:
        """The token ids a :class:`~rl2gem.rollout.Rollout` would have built had the model written
        each assistant turn of ``messages``: one sequence for supervised fine-tuning.

        The prompt is :meth:`prompt_ids` of the messages before the first assistant turn; each
        assistant turn is ``encode(content)`` followed by ``stop_token`` (action mask 1, the stop
        token included, so the model learns to stop); the messages after it up to the next
        assistant turn (env replies) are appended as :meth:`delta` ids (mask 0). Messages after
        the last assistant turn are appended the same way. ``messages`` are used as given (the
        renderer's ``system_prompt`` is not added). ``logprobs`` are 0.0, ``versions`` -1 and
        ``rewards`` 0.0 on every token.

        Args:
            messages: ``{"role", "content"}`` dicts with roles ``system``, ``user``,
                ``assistant`` or ``tool`` and string contents; at least one non-assistant
                message before the first assistant turn, and at least one assistant turn.
            tools: OpenAI-style function schemas rendered by the template (see :meth:`render`).
            stop_token: the id that ends each assistant turn; default the tokenizer's
                ``eos_token_id`` (``<|im_end|>`` for SmolLM2 / ChatML models).

        Returns:
            a :class:`Sequence` (all five lists of the same length).

        Raises:
            ValueError: a malformed message, no assistant turn, an assistant turn first, no
                stop token (the tokenizer has no ``eos_token_id``), or a template that rewrites
                earlier turns (the conversation cannot be one sequence).
        """
        _check_conversation(messages)
        if stop_token is None:
            stop_token = getattr(self.tokenizer, "eos_token_id", None)
            if stop_token is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token=")
        stop_token = int(stop_token)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        sequence = Sequence()
        sequence.extend_context(self.prompt_ids(messages[:first], tools))
        position = first
        while position < len(messages):
            content = messages[position]["content"]
            action_ids = self.encode(content) + [stop_token]
            sequence.extend_action(action_ids, [0.0] * len(action_ids), -1)
            following = position + 1
            while following < len(messages) and messages[following]["role"] != "assistant":
                following += 1
            replies = list(messages[position + 1 : following])
            if replies or following < len(messages):
                turn = self.delta(list(messages[:position]), content, replies, stop_token, tools)
                if turn.split:
                    raise ValueError(
                        f"the chat template rewrites earlier turns at assistant message {position} "
                        f"({turn.reason}); supervised fine-tuning needs the conversation as one sequence"
                    )
                sequence.extend_context(turn.ids)
            position = following
        return sequence


_ROLES = ("system", "user", "assistant", "tool")


def _check_conversation(messages: list[dict[str, str]]) -> None:
    """Raise ``ValueError`` unless ``messages`` is a conversation :meth:`ChatRenderer.conversation` can tokenise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {number} is not a {{'role', 'content'}} dict: {message!r:.200}")
        if message["role"] not in _ROLES:
            raise ValueError(f"message {number} has role {message['role']!r}; expected one of {', '.join(_ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {number} has non-string content of type {type(message['content']).__name__}")
        extra = assistant_extra_keys(message)
        if extra:
            raise ValueError(f"message {number}: {extra}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("the conversation has no assistant turn (nothing to learn)")
    if roles[0] == "assistant":
        raise ValueError(
            "the conversation starts with an assistant turn; the prompt needs a system or user message first"
        )
