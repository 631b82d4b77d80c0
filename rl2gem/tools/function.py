"""A tool made from a typed Python callable."""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import types
import typing
from collections.abc import Callable
from typing import Any

import pydantic

__all__ = ["FunctionTool", "json_schema_of"]

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def json_schema_of(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a type hint.

    Supported: ``str``, ``int``, ``float``, ``bool``, ``None``, ``list[T]`` /
    ``tuple[T, ...]`` / ``set[T]``, ``dict[str, T]``, ``Literal[...]``,
    ``Enum`` subclasses, ``Optional[T]`` / ``T | None`` and other unions
    (``anyOf``), ``typing.Any`` (no constraint).

    Raises:
        TypeError: for a hint with no JSON counterpart (a class instance, a callable, ...).
    """
    if annotation is Any or annotation is inspect.Parameter.empty:
        return {}
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [m.value for m in annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        schemas = [json_schema_of(a) for a in non_null]
        if len(args) != len(non_null):
            schemas.append({"type": "null"})
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return {
                "type": "array",
                "prefixItems": [json_schema_of(a) for a in args],
                "minItems": len(args),
                "maxItems": len(args),
            }
        return {"type": "array", "items": json_schema_of(args[0])} if args else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object", "additionalProperties": json_schema_of(args[1])} if args else {"type": "object"}
    raise TypeError(f"no JSON schema for the type hint {annotation!r}")


class FunctionTool:
    """A :class:`rl2gem.tools.Tool` from a Python function with type hints.

    The JSON schema of the parameters comes from the signature (see
    :func:`json_schema_of`; parameters without a default are required) and the
    descriptions from the docstring (Google, NumPy, reST or Epydoc style, read
    by ``docstring_parser``). A sync function runs in a worker thread, so a
    slow one does not block the event loop. The return value is sent to the
    model as text: strings as they are, other values as JSON (``repr`` when
    not JSON-serialisable). An exception becomes the text
    ``"Error: <Type>: <message>"``.

    Example::

        def add(a: int, b: int) -> int:
            '''Add two integers.

            Args:
                a: the first addend.
                b: the second addend.
            '''
            return a + b

        tool = FunctionTool(add)
        tool.parameters  # {"type": "object", "properties": {"a": {"type": "integer", ...}, ...}, "required": ["a", "b"]}

    Args:
        fn: the callable (sync or ``async def``).
        name: the tool name (default ``fn.__name__``).
        description: default: the docstring's summary.
        instructions: extra text for the model.

    Raises:
        TypeError: a parameter has no type hint with a JSON counterpart, or is ``*args``/``**kwargs``.
    """

    def __init__(
        self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None, instructions: str = ""
    ):
        import docstring_parser

        self.fn = fn
        self.name = name or fn.__name__
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        self.description = (
            description or " ".join(x for x in (doc.short_description, doc.long_description) if x) or self.name
        )
        self.instructions = instructions
        param_docs = {p.arg_name: p.description for p in doc.params}
        hints = typing.get_type_hints(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        self._types: dict[str, pydantic.TypeAdapter] = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{self.name}: *args/**kwargs parameters cannot be described to a model")
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(f"{self.name}: parameter {p.name!r} is positional-only; a model names its arguments")
            if p.name not in hints:
                raise TypeError(f"{self.name}: parameter {p.name!r} has no type hint")
            schema = json_schema_of(hints[p.name])
            self._types[p.name] = pydantic.TypeAdapter(hints[p.name])
            if param_docs.get(p.name):
                schema["description"] = param_docs[p.name]
            if p.default is p.empty:
                required.append(p.name)
            elif p.default is None or isinstance(p.default, (str, int, float, bool)):
                schema["default"] = p.default
            props[p.name] = schema
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }

    async def call(self, arguments: dict[str, Any]) -> str:
        """Call the function with ``arguments`` (keyword arguments), each converted to its parameter's
        type hint (a JSON string to an ``Enum``, a list to a ``tuple``, ``3.0`` to an ``int``...: what
        the schema offered the model); see the class doc for the result text."""
        converted = {}
        for key, value in arguments.items():
            try:
                converted[key] = self._types[key].validate_python(value) if key in self._types else value
            except pydantic.ValidationError as e:
                problem = e.errors()[0]
                where = ".".join(str(part) for part in (key, *problem["loc"]))
                return f"Error: {self.name}: argument {where}: {problem['msg']}"
        arguments = converted
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = await self.fn(**arguments)
            else:
                value = await asyncio.to_thread(self.fn, **arguments)
        except Exception as e:  # the model sees the failure and may retry
            return f"Error: {type(e).__name__}: {e}"
        if isinstance(value, str):
            return value
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            return repr(value)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name})"
