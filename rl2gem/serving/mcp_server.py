"""An env's tools as an MCP server (``python -m rl2gem.envserver ENV_ID --mcp``).

The tools are the env's own (:func:`rl2gem.tools.env_tools`: a :class:`rl2gem.tools.ToolEnvWrapper`'s
tools, e.g. ``rl2/PythonMath-v0``'s sandboxed Python, and an env's ``agent_tools()``, e.g.
``rl2/SearchQA-v0``'s search over its index), served by the ``mcp`` package's low-level
:class:`mcp.server.lowlevel.Server` over stdio or Streamable HTTP, so any MCP client (an agent
framework, an IDE, :class:`rl2gem.tools.MCPServerTools`) can list and call them. The env server's
JSON-RPC ``POST /mcp`` route answers the same ``tools/list`` and ``tools/call`` from the same
:class:`EnvToolbox`.

A call runs as in an rl2gem env (:func:`rl2gem.tools.run_tool_calls`): the arguments are checked
against the tool's JSON schema first; an unknown tool or bad arguments come back as a result with
``isError`` and the reason, never as a protocol error that ends the client's session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from rl2gem.registry import make
from rl2gem.tools import ToolCall, env_tools, run_tool_calls

__all__ = ["EnvToolbox", "mcp_server", "serve_mcp_stdio", "mcp_http_app"]


class EnvToolbox:
    """The tools of one env, listed and called by name.

    Args:
        env: the env whose tools are served (kept open for the tools; :meth:`close` closes it).

    Raises:
        ValueError: two tools with one name (from :func:`rl2gem.tools.env_tools`).
    """

    def __init__(self, env: Any):
        self.env = env
        self.tools = {tool.name: tool for tool in env_tools(env)}

    @classmethod
    def of(cls, env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> EnvToolbox:
        """The toolbox of a new ``env_id`` env made with ``env_kwargs``."""
        return cls(make(env_id, **dict(env_kwargs or {})))

    def listing(self) -> list[dict[str, Any]]:
        """``tools/list``'s tools: ``[{"name", "description", "inputSchema"}]``."""
        return [
            {"name": tool.name, "description": tool.description, "inputSchema": tool.parameters}
            for tool in self.tools.values()
        ]

    async def call(self, name: str, arguments: Any) -> tuple[str, bool]:
        """Run tool ``name`` on ``arguments``: ``(text, is_error)``; ``is_error`` when the call
        could not run (unknown tool, arguments that are not an object or do not match the schema).
        Never raises."""
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return f"Error: the arguments must be a JSON object, got {type(arguments).__name__}.", True
        (text, error), *_ = await run_tool_calls(self.tools, [ToolCall(name, arguments, "")])
        return text, error is not None

    async def aclose(self) -> None:
        """Close the tools that hold resources (``aclose``), then the env."""
        for tool in self.tools.values():
            if hasattr(tool, "aclose"):
                with contextlib.suppress(Exception):
                    await tool.aclose()
        with contextlib.suppress(Exception):
            self.env.close()


def mcp_server(toolbox: EnvToolbox, name: str):
    """A :class:`mcp.server.lowlevel.Server` named ``name`` that lists and calls ``toolbox``'s tools."""
    import mcp.types as types
    from mcp.server.lowlevel import Server

    import rl2gem

    async def list_tools(context, params) -> types.ListToolsResult:
        tools = [
            types.Tool(name=t["name"], description=t["description"], input_schema=t["inputSchema"])
            for t in toolbox.listing()
        ]
        return types.ListToolsResult(tools=tools)

    async def call_tool(context, params) -> types.CallToolResult:
        text, is_error = await toolbox.call(params.name, params.arguments)
        return types.CallToolResult(content=[types.TextContent(text=text)], is_error=is_error)

    return Server(name, version=rl2gem.__version__, on_list_tools=list_tools, on_call_tool=call_tool)


async def serve_mcp_stdio(server) -> None:
    """Serve ``server`` on this process's stdin and stdout until stdin closes."""
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def mcp_http_app(server, host: str):
    """The Starlette app serving ``server`` over Streamable HTTP at ``/mcp`` (the MCP SDK's; DNS
    rebinding protection on for a loopback ``host``)."""
    return server.streamable_http_app(host=host)
