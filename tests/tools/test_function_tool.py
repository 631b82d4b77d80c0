"""FunctionTool: schemas from type hints and docstrings, calls off the event loop."""

import asyncio
import enum
import threading
import time
from typing import Literal, Optional

import pytest

from rl2gem.tools import FunctionTool, ToolArgumentError, json_schema_of, validate_arguments


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def book(
    city: str,
    nights: int,
    rate: float = 99.5,
    tags: list[str] | None = None,
    mode: Literal["fast", "cheap"] = "fast",
    color: Color = Color.RED,
    extras: dict[str, int] | None = None,
) -> dict:
    """Book a hotel.

    Args:
        city: where to stay.
        nights: how many nights.
        rate: price per night in euros.
    """
    return {"city": city, "nights": nights}


def test_schema_from_signature_and_docstring():
    tool = FunctionTool(book)
    assert tool.name == "book" and tool.description == "Book a hotel."
    p = tool.parameters
    assert p["required"] == ["city", "nights"] and p["additionalProperties"] is False
    assert p["properties"]["city"] == {"type": "string", "description": "where to stay."}
    assert p["properties"]["nights"] == {"type": "integer", "description": "how many nights."}
    assert p["properties"]["rate"] == {"type": "number", "description": "price per night in euros.", "default": 99.5}
    assert p["properties"]["tags"] == {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
        "default": None,
    }
    assert p["properties"]["mode"] == {"enum": ["fast", "cheap"], "default": "fast"}
    assert p["properties"]["color"] == {"enum": ["red", "blue"]}
    assert p["properties"]["extras"]["anyOf"][0] == {"type": "object", "additionalProperties": {"type": "integer"}}


def test_json_schema_of_rejects_unknown_hints_and_fn_needs_hints():
    assert json_schema_of(Optional[int]) == {"anyOf": [{"type": "integer"}, {"type": "null"}]}  # noqa: UP045 (the typing form is tested)
    assert json_schema_of(tuple[int, str])["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    with pytest.raises(TypeError):
        json_schema_of(object)
    with pytest.raises(TypeError, match="no type hint"):
        FunctionTool(lambda x: x)
    with pytest.raises(TypeError, match=r"\*args"):

        def f(*a: int) -> int: ...

        FunctionTool(f)


def test_validation_against_the_schema():
    tool = FunctionTool(book)
    validate_arguments(tool, {"city": "Rome", "nights": 2})
    for bad, msg in [
        ({"city": "Rome"}, "'nights' is a required property"),
        ({"city": "Rome", "nights": "two"}, "'two' is not of type 'integer'"),
        ({"city": "Rome", "nights": 1, "mode": "slow"}, "'slow' is not one of"),
        ({"city": "Rome", "nights": 1, "pets": True}, "Additional properties"),
    ]:
        with pytest.raises(ToolArgumentError, match=msg):
            validate_arguments(tool, bad)


def test_results_errors_and_no_blocking():
    barrier = threading.Barrier(4, timeout=30)

    def slow(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        barrier.wait()  # raises BrokenBarrierError unless all four calls are running at once
        return "slept"

    async def fails(x: int) -> int:
        """Fail."""
        raise RuntimeError(f"bad {x}")

    async def main():
        tool = FunctionTool(slow)
        results = await asyncio.gather(*(tool.call({"seconds": 0.1}) for _ in range(4)))
        return (
            results,
            await FunctionTool(fails).call({"x": 3}),
            await FunctionTool(book).call({"city": "Oslo", "nights": 1}),
        )

    results, err, as_json = asyncio.run(main())
    assert results == ["slept"] * 4  # the four blocking calls met at the barrier: they ran in threads
    assert err == "Error: RuntimeError: bad 3"
    assert as_json == '{"city": "Oslo", "nights": 1}'


def test_arguments_reach_the_function_as_its_type_hints_say():
    """JSON values went in as they were: an Enum parameter got "red", a tuple a list, an int 3.0, so
    calls the schema accepted failed in the function; a positional-only parameter was offered by name."""

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    def paint(color: Color, corner: tuple[int, int], times: int) -> str:
        """Paint."""
        return f"{color.name} at {hash(corner) == hash((1, 2))} x{'ab' * times}"

    tool = FunctionTool(paint)
    arguments = {"color": "red", "corner": [1, 2], "times": 3.0}
    validate_arguments(tool, arguments)  # the schema takes them as JSON has them
    assert asyncio.run(tool.call(arguments)) == "RED at True xababab"
    assert asyncio.run(tool.call({**arguments, "color": "green"})).startswith("Error: paint: argument color:")

    def positional(a: int, /) -> int:
        """Positional."""
        return a

    with pytest.raises(TypeError, match="positional-only"):
        FunctionTool(positional)
