"""The OpenAI-compatible HTTP API of ``python -m rl2gem.serve``, and the conversions between
OpenAI messages and rl2gem's text protocol.

Routes (added to :func:`rl2gem.serving.make_app`), following the OpenAI API reference:

==============================  ==========================================================
``GET /v1/models``              the one served model (``id`` = ``--served-model-name``)
``POST /v1/chat/completions``   ``messages`` (text content, or a list of ``{"type": "text"}``
                                parts), ``tools`` (rendered by the chat template), ``tool_choice``
                                (``auto`` or ``none``), ``max_tokens`` / ``max_completion_tokens``,
                                ``temperature``, ``top_p``, ``n``, ``seed``, ``stop``, ``logprobs``,
                                ``stream`` (server-sent events) and ``stream_options.include_usage``.
                                Tool calls the model writes in the Hermes format
                                (``<tool_call>{"name": .., "arguments": {..}}</tool_call>``) come back
                                as ``message.tool_calls`` with ``finish_reason="tool_calls"``.
``POST /v1/completions``        ``prompt`` (text, a list of texts, token ids or a list of those),
                                ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``n``,
                                ``seed``, ``stop``, ``logprobs`` (0 or 1), ``stream``
==============================  ==========================================================

Not supported, and answered with HTTP 400 rather than ignored: ``top_logprobs > 0`` (the
engines return the sampled token's log-probability only), ``echo``, a ``tool_choice`` that
forces a call, images and audio, and the parameters :data:`UNSUPPORTED` lists at anything but
their no-op values (``logit_bias``, presence and frequency penalties, a JSON ``response_format``,
``best_of``, ``suffix``).

Generation goes through any :class:`~rl2gem.rollout.engines.base.Engine`: the embedded engine
streams token by token; a remote one (``--upstream``, an SGLang server or an ``sglang-router``
in front of several) answers whole completions, so its streams arrive in one piece.

Token-in/token-out: a chat request is rendered by the model's chat template and tokenised
exactly as :class:`rl2gem.rollout.tito.ChatRenderer` does for a rollout's first turn, so a
conversation played through this API sees the same prompt tokens as a local evaluation with the
same chat template (``serve --chat-template`` for the API, ``chat_template=`` for ``evaluate``). Later
turns are re-rendered from the messages (the API is stateless); where a reply does not
re-tokenise to the ids that were sampled, the tokens differ from those of a prefix-merged local
rollout (:mod:`rl2gem.rollout.tito`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from aiohttp import web
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rl2gem.aio import read_json_object
from rl2gem.rollout.engines.base import Engine, EngineError, GenerateOutput, SamplingParams
from rl2gem.rollout.tito import ChatRenderer
from rl2gem.tools.base import (
    hermes_tool_calls,
    openai_call_arguments,
    parse_tool_calls,
    remove_tool_calls,
    without_tool_call_blocks,
)

__all__ = [
    "IncrementalText",
    "add_openai_routes",
    "OpenAIRoutes",
    "OpenAIRequestError",
    "openai_tool_calls",
    "template_messages",
]


#: OpenAI parameters the engines cannot honour, with the values that ask for nothing (accepted)
UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the pre-tools form of function calling: send tools
    "function_call": (None, "auto", "none"),
}


class OpenAIRequestError(ValueError):
    """A request the API cannot serve (answered with HTTP 400 and OpenAI's error body)."""


class UnknownModel(OpenAIRequestError):
    """A request for a model this server does not serve (answered with HTTP 404, as OpenAI does)."""

    def __init__(self, model: Any, served: str):
        super().__init__(f"model {model!r} is not served here; /v1/models lists {served!r}")
        self.model = model


def _unknown_model(model: Any, served: str):
    return _error(
        f"the model {model!r} does not exist here; /v1/models lists {served!r}"[:300],
        404,
        "invalid_request_error",
        code="model_not_found",
    )


# --------------------------------------------------------------------------- conversions
def openai_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a reply into its prose and its tool calls in OpenAI's format.

    Returns:
        ``(content, tool_calls)``: ``tool_calls`` are ``{"id", "type": "function", "function":
        {"name", "arguments": JSON text}}``; ``content`` is the text outside the calls (``None``
        when empty). A reply with a malformed call comes back whole as content with no calls, so
        the caller sees what the model wrote.
    """
    calls = parse_tool_calls(text)
    if not calls or any(c.error for c in calls) or "<tool_call>" not in text:
        return text, []
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]
    return remove_tool_calls(text) or None, out


def _text(content: Any, role: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIRequestError(f"{role} message: only text content parts are supported, got {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise OpenAIRequestError(f"{role} message: content must be a string or a list of text parts")


def template_messages(messages: Any, *, template_reads_tool_calls: bool = False) -> list[dict[str, Any]]:
    """OpenAI chat messages as the ``{"role", "content"}`` dicts a chat template renders.

    An assistant message's ``tool_calls`` become Hermes ``<tool_call>`` blocks after its content
    (what the model wrote), unless the template renders ``tool_calls`` itself
    (``template_reads_tool_calls``: they are then passed on, arguments decoded to objects).

    Raises:
        OpenAIRequestError: not a non-empty list of messages with known roles.
        ValueError: a tool call without a function name.
    """
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise OpenAIRequestError(f"each message needs a role of system, user, assistant or tool: {m!r}"[:300])
        role = "system" if m["role"] == "developer" else m["role"]
        content = _text(m.get("content"), role)
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if template_reads_tool_calls:
                decoded = [
                    {"type": "function", "function": {"name": name, "arguments": arguments}}
                    for name, arguments in openai_call_arguments(calls)
                ]
                out.append({"role": role, "content": content, "tool_calls": decoded})
                continue
            content = (content + "\n" if content else "") + hermes_tool_calls(calls)
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------- the API
@dataclass
class _Choice:
    """One generated choice's progress while it streams."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_chars: int = 0  # characters of the text already sent
    sent_tokens: int = 0  # tokens whose log-probs were sent
    output: GenerateOutput | None = None
    started: bool = False  # a chunk of it was sent (the first carries the role)
    text: str = ""
    stopped_at: int | None = None  # where a stop string cut the text
    streamed: Any = None  # an IncrementalText of ids while it streams


class IncrementalText:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` kept up to date as ``ids`` grows: each
    update decodes the new tokens together with at least :attr:`CONTEXT` tokens before them (the
    context that leading spaces, byte-level merges and the clean-up of spaces before punctuation
    depend on) and keeps what the new tokens add, as vLLM's incremental detokenization does. A
    streamed reply of ``n`` tokens then costs O(n) decoding, not O(n^2), on the event loop that
    serves every stream (``benchmarks/detokenize.py``: 0.35 against 0.017 s for a 2,000-token
    reply, 5.7 against 0.09 s for 8,000, on the 2-core CPU). Where the context decodes to nothing
    (special tokens only: a SentencePiece decoder would drop the next word's space) or to
    something the longer decode does not start with, the whole text is decoded again."""

    CONTEXT = 6  # tokens

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._ends = [0]  # token counts at which an update completed (character boundaries), recent ones

    def update(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` (the ids given before, extended), or None while its last character
        is incomplete (a multi-byte character split over tokens: nothing is taken then)."""
        end = self._ends[-1]
        start = next((b for b in reversed(self._ends) if end - b >= self.CONTEXT), 0)
        fresh = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        if fresh.endswith("\ufffd"):
            return None
        known = self.tokenizer.decode(ids[start:end], skip_special_tokens=True) if start < end else ""
        if start == end:  # nothing decoded yet: the whole text
            self.text = fresh
        elif known and fresh.startswith(known):
            self.text += fresh[len(known) :]
        else:
            self.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._ends.append(len(ids))
        while len(self._ends) > 1 and len(ids) - self._ends[1] >= self.CONTEXT:
            self._ends.pop(0)  # a later boundary is context enough: no update starts here again
        return self.text


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise OpenAIRequestError("stop must be a string or a list of at most 4 non-empty strings")
    return stops


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))  # 1e400 is valid JSON: inf
        or (kind is int and value != int(value))
    ):
        raise OpenAIRequestError(f"{key} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    try:
        value = kind(value)
    except OverflowError:  # an integer past a float's range (10**400)
        raise OpenAIRequestError(f"{key} is out of range, got {value}"[:200]) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise OpenAIRequestError(f"{key} must be in [{low}, {high}], got {value}")
    return value


def _held_back(text: str, markers: list[str]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers`` (kept unsent until
    the next tokens tell)."""
    keep = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                keep = max(keep, k)
                break
    return keep


def add_openai_routes(routes, engine: Engine, tokenizer, **options: Any) -> OpenAIRoutes:
    """Add the ``/v1`` routes (see the module doc) to an aiohttp ``RouteTableDef``; returns the
    :class:`OpenAIRoutes` that serves them (``options``: its keyword arguments)."""
    api = OpenAIRoutes(engine, tokenizer, **options)
    routes.get("/v1/models")(api.models)
    routes.get("/v1/models/{model}")(api.model)
    routes.post("/v1/chat/completions")(api.chat_completions)
    routes.post("/v1/completions")(api.completions)
    return api


def _error(message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None):
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status)


def _abort_message(choices: list[_Choice]) -> str | None:
    """Why the engine aborted a choice (a pause in abort mode, a weight update, an engine error):
    its text is cut short, which a finish reason of ``stop`` would hide from the client; None when
    every choice finished."""
    for choice in choices:
        if choice.output is not None and choice.output.aborted:
            message = choice.output.finish_reason.get("message") or "aborted"
            return f"the engine aborted the request ({message}); send it again"
    return None


def _aborted(choices: list[_Choice]):
    """A 503 error response when the engine aborted a choice (:func:`_abort_message`), else None."""
    message = _abort_message(choices)
    return None if message is None else _error(message, 503, "server_error")


def _usage(prompt: list[int], choices: list[_Choice]) -> dict[str, int]:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


class OpenAIRoutes:
    """The OpenAI API over an :class:`Engine`: one method per route (aiohttp handlers).

    Args:
        engine: generates (any :class:`Engine`).
        tokenizer: the served model's tokenizer (chat template, detokenisation).
        model_name: the ``id`` of ``/v1/models``; requests may name it or leave ``model`` out.
        chat_template: overrides the tokenizer's template (text).
        context_length: prompt + completion limit (default: the engine's, else 4096).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        *,
        model_name: str,
        chat_template: str | None = None,
        context_length: int | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.reads_tool_calls = "tool_calls" in str(chat_template or tokenizer.chat_template or "")
        self.limit = int(context_length or getattr(engine, "context_length", 0) or 4096)
        # a byte-level BPE vocabulary's character -> byte (GPT-2's table), for log-prob entries' bytes
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_of = {character: byte for byte, character in bytes_to_unicode().items()} if byte_level else {}

    # ------------------------------------------------------------------ routes
    def _model_entry(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rl2gem"}

    async def models(self, _request):
        """``GET /v1/models``."""
        return web.json_response({"object": "list", "data": [self._model_entry()]})

    async def model(self, request):
        """``GET /v1/models/{model}``: the served model, or 404."""
        if request.match_info["model"] != self.model_name:
            return _unknown_model(request.match_info["model"], self.model_name)
        return web.json_response(self._model_entry())

    async def chat_completions(self, request):
        """``POST /v1/chat/completions``."""
        try:
            body = await read_json_object(request)
            self._check_common(body, chat=True)
            tools = self._tools(body)
            messages = template_messages(body.get("messages"), template_reads_tool_calls=self.reads_tool_calls)
            prompt = self.renderer.prompt_ids(messages, tools=tools)
            params, stops = self._sampling(body, len(prompt), None)
        except UnknownModel as e:
            return _unknown_model(e.model, self.model_name)
        except (OpenAIRequestError, ValueError, TypeError, jinja2.TemplateError) as e:  # a template's raise_exception
            return _error(str(e))
        reply = _ChatReply(self, body, tools, prompt)
        if body.get("stream"):
            markers = ["<tool_call>"] if tools else []
            return await self._stream(request, prompt, params, stops, reply, markers + stops)
        return await reply.whole(params, stops)

    async def completions(self, request):
        """``POST /v1/completions``."""
        try:
            body = await read_json_object(request)
            self._check_common(body, chat=False)
            prompts = self._completion_prompts(body.get("prompt"))
            logprobs = _number(body, "logprobs", None, int, 0, 1)
            plans = [self._sampling(body, len(p), 16) for p in prompts]
            if body.get("stream") and len(prompts) > 1:
                raise OpenAIRequestError("stream=true takes one prompt")
        except UnknownModel as e:
            return _unknown_model(e.model, self.model_name)
        except (OpenAIRequestError, ValueError, TypeError) as e:
            return _error(str(e))
        reply = _CompletionReply(self, body, logprobs is not None)
        if body.get("stream"):
            params, stops = plans[0]
            return await self._stream(request, prompts[0], params, stops, reply, stops)
        return await reply.whole(prompts, plans)

    # ------------------------------------------------------------------ request checks
    def _check_common(self, body: dict, chat: bool) -> None:
        for key, no_ops in UNSUPPORTED.items():
            if body.get(key) not in no_ops:
                raise OpenAIRequestError(f"{key}={body[key]!r} is not supported (the engine would ignore it)"[:300])
        for key in ("stream", "logprobs" if chat else "echo"):
            if body.get(key) is not None and not isinstance(body[key], bool):
                raise OpenAIRequestError(f"{key} must be true or false, got {body[key]!r}"[:200])
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise OpenAIRequestError(f"stream_options must be an object, got {options!r}"[:200])
        if options is not None and not body.get("stream"):
            raise OpenAIRequestError("stream_options is only allowed with stream=true")
        if body.get("model") not in (None, self.model_name):
            raise UnknownModel(body.get("model"), self.model_name)
        if body.get("top_logprobs"):
            raise OpenAIRequestError("top_logprobs > 0 is not supported: the engine returns the sampled token's only")
        if body.get("echo"):
            raise OpenAIRequestError("echo is not supported")

    def _tools(self, body: dict) -> list[dict] | None:
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise OpenAIRequestError("tools must be a list of function schemas")
        for position, tool in enumerate(
            tools or []
        ):  # the API's shape: {"type": "function", "function": {"name", ...}}
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise OpenAIRequestError(f"tools[{position}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise OpenAIRequestError(f"tools[{position}].function.name must be a non-empty string")
            if not isinstance(function.get("parameters", {}), dict):
                raise OpenAIRequestError(f"tools[{position}].function.parameters must be a JSON schema object")
        choice_mode = body.get("tool_choice", "auto")
        if choice_mode not in ("auto", "none", None):
            raise OpenAIRequestError(f"tool_choice {choice_mode!r} is not supported (auto or none)")
        if choice_mode == "none":
            return None
        if tools and not self.renderer.supports_tools:
            raise OpenAIRequestError("this model's chat template does not render tools; serve it with --chat-template")
        return tools

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise OpenAIRequestError("prompt must be a string, a list of token ids, or a non-empty list of those")
        for p in prompts:
            if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise OpenAIRequestError("a prompt given as token ids must hold integers only")
        ids = [self.renderer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if any(not p for p in ids):
            raise OpenAIRequestError("a prompt is empty")
        return ids

    def _sampling(self, body: dict, prompt_len: int, default_max: int | None) -> tuple[list[SamplingParams], list[str]]:
        room = self.limit - prompt_len - 1  # below the context, as SGLang (an --upstream) requires
        if room < 1:
            raise OpenAIRequestError(f"the prompt has {prompt_len} tokens; this model's context is {self.limit}")
        requested = body.get("max_completion_tokens")
        if requested is None:  # absent, or null (the openai client's None): max_tokens, its older name
            requested = body.get("max_tokens")
        # 0 is a value (refused below), not "not given"
        max_tokens = (room if default_max is None else default_max) if requested is None else requested
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", room, int, 1, None)
        if requested is not None and max_tokens > room:  # as vLLM and SGLang: refused, not cut short
            raise OpenAIRequestError(
                f"this model's context is {self.limit} tokens; the prompt has {prompt_len} and max_tokens asks for "
                f"{max_tokens} more (at most {room} fit)"
            )
        n = _number(body, "n", 1, int, 1, 16)
        seed = _number(body, "seed", None, int)
        params = [
            SamplingParams(
                max_new_tokens=min(max_tokens, room),
                temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, float, 1e-6, 1.0),
                sampling_seed=None if seed is None else seed + i,
            )
            for i in range(n)
        ]
        return params, _stop_strings(body.get("stop"))

    # ------------------------------------------------------------------ generation
    def finish(self, choice: _Choice, stops: list[str]) -> str:
        """Set the choice's final text (cut at a stop string); return the OpenAI finish reason."""
        text = self.tokenizer.decode(choice.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            choice.text, choice.stopped_at = text[:cut], cut
            return "stop"
        choice.text = text
        kind = choice.output.finish_reason.get("type") if choice.output else "stop"
        return "length" if kind == "length" else "stop"

    def token_logprobs(self, ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
        """Chat-style log-prob entries of ``ids``. ``bytes`` are the token's own bytes (a
        byte-level BPE token can be part of a character, which its decoded text shows as U+FFFD;
        the bytes of consecutive tokens join to the UTF-8 text)."""
        out = []
        for t, lp in zip(ids, lps, strict=True):
            piece = self.tokenizer.decode([t])
            out.append({"token": piece, "logprob": lp, "bytes": self._token_bytes(t, piece), "top_logprobs": []})
        return out

    def _token_bytes(self, token_id: int, piece: str) -> list[int]:
        token = self.tokenizer.convert_ids_to_tokens(token_id) if self.byte_of else None
        if token and all(character in self.byte_of for character in token):
            return [self.byte_of[character] for character in token]
        return list(piece.encode())

    async def run_choices(
        self,
        prompt: list[int],
        params: list[SamplingParams],
        first: int = 0,
        on_token: Callable | None = None,
        stops: Sequence[str] = (),
    ) -> list[_Choice]:
        """Generate one choice per ``params`` (indices from ``first``), concurrently. A choice
        whose text meets one of ``stops`` (found here, or by ``on_token``, which sets
        ``stopped_at``) ends at the token that completed it: its engine request is aborted, so
        no token past the stop string is generated, counted or given log-probs."""
        choices = [_Choice(first + i) for i in range(len(params))]

        async def run(choice: _Choice, sampling: SamplingParams) -> None:
            async with contextlib.aclosing(self.engine.generate_stream(prompt, sampling)) as stream:
                async for item in stream:
                    if isinstance(item, GenerateOutput):
                        choice.output = item
                        continue
                    choice.ids.append(item[0])
                    choice.logprobs.append(item[1])
                    if on_token is not None:
                        await on_token(choice)
                    elif stops:
                        self._find_stop(choice, stops)
                    if choice.stopped_at is not None:
                        break  # closing the stream aborts the engine's request

        tasks = [asyncio.ensure_future(run(c, p)) for c, p in zip(choices, params, strict=True)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # one choice failed, or the client left: the others stop too (their slots free)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return choices

    def _find_stop(self, choice: _Choice, stops: Sequence[str]) -> str | None:
        """Set ``choice.stopped_at`` where its text so far first meets a stop string; return that
        text (decoded incrementally), or None while a multi-byte character is not complete."""
        choice.streamed = choice.streamed or IncrementalText(self.tokenizer)
        text = choice.streamed.update(choice.ids)
        if text is not None:
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                choice.stopped_at = cut
        return text

    async def _stream(self, request, prompt, params, stops, reply, markers):
        """Server-sent events: ``reply.chunk(choice, text, logprob_entries)`` for new text,
        ``reply.final(choice, reason, rest, entries)`` when a choice ends, ``reply.usage_chunk`` last
        when the request asked for usage. The headers go with the first event: a request the engine
        refuses before any (a token id past the vocabulary) gets its 400 as a whole response. A
        choice the engine aborted ends the stream with an error event, not a finish reason."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        lock = asyncio.Lock()
        tool_prose = "<tool_call>" in markers  # a chat reply whose content is its text without the calls

        async def send(obj: dict) -> None:
            async with lock:
                if not response.prepared:
                    await response.prepare(request)
                await response.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

        async def on_token(choice: _Choice) -> None:
            if choice.stopped_at is not None:
                return
            text = self._find_stop(choice, stops)
            if text is None:  # a multi-byte character is not complete yet
                return
            if choice.stopped_at is not None:  # a stop string: send what precedes it, then nothing more
                end = choice.stopped_at
            else:
                end = len(text) - _held_back(text, markers)
            start = choice.sent_chars
            if tool_prose:  # as remove_tool_calls: no call, and the content stripped at both ends
                if (i := text.find("<tool_call>")) >= 0:  # a tool call: sent whole at the end
                    end = min(end, i)  # (also before a stop string: the call is no content)
                end = min(end, len(text[:end].rstrip()))  # trailing space waits: it may end the content
                if not choice.started:
                    start = max(start, len(text[:end]) - len(text[:end].lstrip()))
            if end > start:
                new_lps = self.token_logprobs(choice.ids[choice.sent_tokens :], choice.logprobs[choice.sent_tokens :])
                choice.sent_tokens = len(choice.ids)
                await send(reply.chunk(choice, text[start:end], new_lps, offset=start))
                choice.sent_chars = end

        # a client that leaves mid-stream makes a write fail with ConnectionResetError: its choices are
        # cancelled (run_choices), and nothing more is written to the closed transport
        with contextlib.suppress(ConnectionResetError):
            try:
                choices = await self.run_choices(prompt, params, on_token=on_token)
            except ConnectionResetError:
                raise
            except Exception as e:
                if not response.prepared:  # nothing sent yet: an error response as without streaming
                    if isinstance(e, EngineError):
                        return _error(str(e), 502, "server_error")
                    if isinstance(e, ValueError):
                        return _error(str(e))
                await send({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
                await response.write(b"data: [DONE]\n\n")
                return response
            if (aborted := _abort_message(choices)) is not None:
                await send({"error": {"message": aborted, "type": "server_error", "param": None, "code": None}})
                await response.write(b"data: [DONE]\n\n")
                return response
            for c in choices:
                reason = self.finish(c, stops)
                rest = self.token_logprobs(c.ids[c.sent_tokens :], c.logprobs[c.sent_tokens :])
                await send(reply.final(c, reason, c.text[c.sent_chars :], rest))
            if reply.include_usage:
                await send(reply.usage_chunk(_usage(prompt, choices)))
            await response.write(b"data: [DONE]\n\n")
        return response


class _ChatReply:
    """The response objects of one ``/v1/chat/completions`` request."""

    def __init__(self, api: OpenAIRoutes, body: dict, tools: list[dict] | None, prompt: list[int]):
        self.api, self.tools, self.prompt = api, tools, prompt
        self.want_logprobs = bool(body.get("logprobs"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": api.model_name}

    def message(self, choice: _Choice, reason: str) -> tuple[dict, str]:
        content, calls = openai_tool_calls(choice.text) if self.tools else (choice.text, [])
        if self.tools and content is not None:  # stripped with tools offered, calls or not: as streamed
            content = content.strip() or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls"
        return message, reason

    async def whole(self, params: list[SamplingParams], stops: list[str]):
        api = self.api
        try:
            choices = await api.run_choices(self.prompt, params, stops=stops)
        except ValueError as e:
            return _error(str(e))
        except EngineError as e:  # the upstream engine failed or is unreachable: not the request's fault
            return _error(str(e), 502, "server_error")
        if failed := _aborted(choices):
            return failed
        out = []
        for c in choices:
            message, reason = self.message(c, api.finish(c, stops))
            entry = {"index": c.index, "message": message, "finish_reason": reason, "logprobs": None}
            if self.want_logprobs:  # the generated tokens, up to the one that completed a stop string
                entry["logprobs"] = {"content": api.token_logprobs(c.ids, c.logprobs)}
            out.append(entry)
        return web.json_response(
            {
                **self.head,
                "object": "chat.completion",
                "choices": out,
                "usage": _usage(self.prompt, choices),
                "system_fingerprint": f"rl2gem-w{api.engine.weight_version}",
            }
        )

    def chunk(self, choice, text, lps, reason=None, extra=None, offset=0):
        delta: dict[str, Any] = {} if choice.started else {"role": "assistant"}
        choice.started = True
        if text:
            delta["content"] = text
        delta.update(extra or {})
        entry = {"index": choice.index, "delta": delta, "finish_reason": reason}
        entry["logprobs"] = {"content": lps} if self.want_logprobs else None
        return {**self.head, "object": "chat.completion.chunk", "choices": [entry]}

    def final(self, choice, reason, rest, lps):
        extra: dict[str, Any] = {}
        if self.tools:  # the text not yet sent, stripped at both ends of the whole content (message())
            _, calls = openai_tool_calls(choice.text)
            if calls:  # the calls were held back: send them whole, with the prose around them
                rest = without_tool_call_blocks(rest)
                extra["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                reason = "tool_calls"
            rest = rest.rstrip() if choice.started else rest.strip()  # no call: a malformed block is text
        return self.chunk(choice, rest, lps, reason, extra)

    def usage_chunk(self, usage):
        return {**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage}


class _CompletionReply:
    """The response objects of one ``/v1/completions`` request."""

    def __init__(self, api: OpenAIRoutes, body: dict, logprobs: bool):
        self.api, self.logprobs = api, logprobs
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": api.model_name,
        }

    def legacy_logprobs(self, ids: list[int], lps: list[float], offset: int = 0) -> dict | None:
        """The legacy ``logprobs`` object of ``ids``; ``text_offset`` counts from ``offset`` (the
        characters a stream sent before these tokens)."""
        if not self.logprobs:
            return None
        pieces = [self.api.tokenizer.decode([t]) for t in ids]
        offsets, at = [], offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    async def whole(self, prompts: list[list[int]], plans):
        out, total = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        try:
            for prompt, (params, stops) in zip(prompts, plans, strict=True):
                choices = await self.api.run_choices(prompt, params, first=len(out), stops=stops)
                if failed := _aborted(choices):
                    return failed
                for c in choices:
                    reason = self.api.finish(c, stops)
                    entry = {"index": c.index, "text": c.text, "finish_reason": reason}
                    entry["logprobs"] = self.legacy_logprobs(c.ids, c.logprobs)
                    out.append(entry)
                for k, v in _usage(prompt, choices).items():
                    total[k] += v
        except ValueError as e:
            return _error(str(e))
        except EngineError as e:
            return _error(str(e), 502, "server_error")
        return web.json_response({**self.head, "choices": out, "usage": total})

    def chunk(self, choice, text, lps, reason=None, offset=0):
        ids = choice.ids[choice.sent_tokens - len(lps) : choice.sent_tokens] if lps else []
        entry = {"index": choice.index, "text": text, "finish_reason": reason}
        entry["logprobs"] = self.legacy_logprobs(ids, [x["logprob"] for x in lps], offset)
        return {**self.head, "choices": [entry]}

    def final(self, choice, reason, rest, lps):
        ids = choice.ids[len(choice.ids) - len(lps) :] if lps else []
        entry = {"index": choice.index, "text": rest, "finish_reason": reason}
        entry["logprobs"] = self.legacy_logprobs(ids, [x["logprob"] for x in lps], choice.sent_chars)
        return {**self.head, "choices": [entry]}

    def usage_chunk(self, usage):
        return {**self.head, "choices": [], "usage": usage}
