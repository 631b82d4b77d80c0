"""The tool protocol, tool-call parsing and the text that offers tools to a model.

A tool is anything with a ``name``, a ``description``, a JSON schema of its
``parameters`` and an async ``call(arguments) -> str`` (:class:`Tool`). The
model calls tools in the format of Hermes-style chat templates (Qwen2.5/3,
Hermes, SmolLM3 and most open instruct models)::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2**10)"}}
    </tool_call>

one block per call, several blocks for parallel calls. A model without such a
template may instead write the same JSON object (or a list of them) in a fenced
code block (a fenced-JSON fallback): a block counts as a call only when it
holds an object with ``"name"`` and ``"arguments"`` (or ``"parameters"``).

:func:`parse_tool_calls` never raises: malformed calls come back as
:class:`ToolCall` objects with ``error`` set, so the env can tell the model
what was wrong and the episode goes on.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Tool",
    "ToolCall",
    "parse_tool_calls",
    "remove_tool_calls",
    "without_tool_call_blocks",
    "tool_schema",
    "tools_prompt",
    "validate_arguments",
    "ToolArgumentError",
    "hermes_tool_calls",
    "openai_call_arguments",
]


@runtime_checkable
class Tool(Protocol):
    """What :class:`rl2gem.tools.ToolEnvWrapper` needs of a tool.

    A tool with state per episode (e.g. ``PythonTool(persistent=True)``) also has
    ``episode() -> Tool``: the wrapper calls it at every reset and runs that
    episode's calls on the result, then calls its ``close()`` (synchronous) when the
    episode ends, at the next reset, or when the env closes.

    Attributes:
        name: the function name the model calls (``[A-Za-z0-9_.-]+``).
        description: one paragraph for the model.
        parameters: JSON schema (an ``"object"`` schema) of the ``arguments``.
        instructions: extra text shown to the model with the tool list (may be ``""``).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    instructions: str

    async def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool. Must not block the event loop; failures are returned as text, not raised."""
        ...


class ToolArgumentError(ValueError):
    """The arguments of a call do not match the tool's JSON schema."""


@dataclasses.dataclass
class ToolCall:
    """One parsed tool call.

    Attributes:
        name: the called function's name (``""`` when it could not be read).
        arguments: the decoded arguments (``{}`` when malformed).
        raw: the text the call was parsed from.
        error: why the call cannot be run (invalid JSON, missing name, ...), or ``None``.
    """

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str | None = None


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FENCED = re.compile(r"```[ \t]*([A-Za-z_]*)[ \t]*\n(.*?)```", re.S)


def openai_call_arguments(tool_calls: Any) -> list[tuple[str, Any]]:
    """``(name, arguments)`` of OpenAI ``tool_calls`` (``{"function": {"name", "arguments": JSON
    text}}``), arguments decoded from their JSON text (kept as text when it is not JSON: the env
    then tells the model so).

    Raises:
        ValueError: not a list, a function that is not an object, or a call without a function
            name (a string).
    """
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list")
    out = []
    for call in tool_calls:
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        if not isinstance(function, dict):
            raise ValueError(f"a tool call's function must be an object, got {function!r}"[:300])
        name = function.get("name")
        if not name or not isinstance(name, str):
            raise ValueError(f"a tool call has no function name: {call!r}"[:300])
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            loaded, problem = _load_json(arguments)
            arguments = arguments if problem else loaded
        out.append((name, arguments))
    return out


def _load_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` for JSON ``text``, else ``(None, why)``: model output may be any text, and
    besides malformed JSON Python refuses integers of more than 4300 digits (``ValueError``) and
    nesting past the recursion limit (``RecursionError``); none of them may end an episode."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at position {e.pos})"
    except RecursionError:
        return None, "nested too deeply to read as JSON"
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        return None, f"not readable as JSON ({str(e)[:120]})"


def hermes_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """OpenAI ``tool_calls`` as the text a Hermes-style model writes, one ``<tool_call>`` block per
    call: what :func:`parse_tool_calls` (and so every rl2gem tool env) reads.

    Raises:
        ValueError: as :func:`openai_call_arguments`.
    """
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
        for name, arguments in openai_call_arguments(tool_calls)
    )


def _call_from_obj(obj: Any, raw: str) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", {}, raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI-style {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall("", {}, raw, 'the tool call has no "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some templates emit the arguments as a JSON string
        args, problem = _load_json(args) if args.strip() else ({}, None)
        if problem:
            return ToolCall(name.strip(), {}, raw, f"the arguments of {name} are {problem}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(
            name.strip(), {}, raw, f'"arguments" of {name} must be a JSON object, got {type(args).__name__}'
        )
    return ToolCall(name.strip(), args, raw)


def _looks_like_call(obj: Any) -> bool:
    """A call object, or a non-empty list of them (one level: never recursive, whatever the nesting)."""

    def call(item: Any) -> bool:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            item = item["function"]
        return isinstance(item, dict) and "name" in item and ("arguments" in item or "parameters" in item)

    return (bool(obj) and all(map(call, obj))) if isinstance(obj, list) else call(obj)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model's reply, in order (``[]`` when there are none).

    ``<tool_call>...</tool_call>`` blocks win; a block cut off by the end of
    the text (generation stopped at ``</tool_call>``) still counts. Without
    tagged blocks, fenced code blocks (```` ```json ````) holding a call
    object or a list of call objects are read. A tagged block whose body is
    not valid JSON, or a list, gives one :class:`ToolCall` per element or one
    with ``error`` set.

    Args:
        text: the model's whole reply (``str``).

    Returns:
        list of :class:`ToolCall`.
    """
    calls: list[ToolCall] = []
    tagged = _TAGGED.findall(text)
    if tagged:
        for body in tagged:
            body = body.strip()
            if not body:
                calls.append(ToolCall("", {}, body, "the <tool_call> block is empty"))
                continue
            obj, problem = _load_json(body)
            if problem:
                calls.append(ToolCall("", {}, body, f"the <tool_call> block is {problem}"))
                continue
            objs = obj if isinstance(obj, list) else [obj]
            calls.extend(_call_from_obj(o, body) for o in objs)
        return calls
    for _lang, body in _FENCED.findall(text):
        obj, problem = _load_json(body)
        if not problem and _looks_like_call(obj):
            objs = obj if isinstance(obj, list) else [obj]
            calls.extend(_call_from_obj(o, body.strip()) for o in objs)
    return calls


def remove_tool_calls(text: str) -> str:
    """``text`` without its ``<tool_call>...</tool_call>`` blocks (a block cut off by the end of the
    text included), stripped: the prose of a reply whose calls :func:`parse_tool_calls` read."""
    return without_tool_call_blocks(text).strip()


def without_tool_call_blocks(text: str) -> str:
    """``text`` without its ``<tool_call>...</tool_call>`` blocks, not stripped (a part of a reply)."""
    return _TAGGED.sub("", text)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI/Hugging Face function schema of ``tool``:
    ``{"type": "function", "function": {"name", "description", "parameters"}}``
    (what ``tokenizer.apply_chat_template(..., tools=[...])`` takes)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The text that offers ``tools`` to the model and explains the call format.

    The schemas are listed one JSON object per line inside ``<tools></tools>``,
    followed by the ``<tool_call>`` format and each tool's own instructions.
    """
    lines = "\n".join(json.dumps(tool_schema(t), ensure_ascii=False) for t in tools)
    text = (
        "You can use the tools listed below, one JSON schema per line.\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To use a tool, write a block like the one below: the tool's name and a JSON object of its arguments, "
        "inside tool_call tags.\n<tool_call>\n"
        + json.dumps({"name": tools[0].name if tools else "tool_name", "arguments": {"argument": "value"}})
        + "\n</tool_call>\nThe result comes back in the next message. Write several blocks to call several tools at once. "
        "When you reply without a tool call, that reply is your final answer."
    )
    extra = [t.instructions.strip() for t in tools if getattr(t, "instructions", "").strip()]
    if extra:
        text += "\n" + "\n".join(extra)
    return text


_validators: dict[int, Any] = {}


def validate_arguments(tool: Tool, arguments: dict[str, Any]) -> None:
    """Check ``arguments`` against ``tool.parameters`` (JSON Schema, via the ``jsonschema`` package).

    Raises:
        ToolArgumentError: with the first violation, e.g.
            ``"python: 'code' is a required property"``.
    """
    import jsonschema

    key = id(tool.parameters)
    entry = _validators.get(key)
    if entry is None or entry[0] is not tool.parameters:
        cls = jsonschema.validators.validator_for(tool.parameters, default=jsonschema.Draft202012Validator)
        entry = _validators[key] = (tool.parameters, cls(tool.parameters))
    error = jsonschema.exceptions.best_match(entry[1].iter_errors(arguments))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ToolArgumentError(f"{tool.name}: {error.message}" + (f" (at {where})" if where else ""))
