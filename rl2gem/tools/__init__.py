"""Tools for LLM agents and the wrapper that gives them to any env.

* :class:`Tool`: the protocol (name, description, JSON-schema ``parameters``,
  ``instructions``, async ``call``).
* :class:`ToolEnvWrapper`: any env + tools; tool calls in the model's own
  chat-template format (Hermes ``<tool_call>`` blocks, fenced JSON as a fallback)
  come back as ``role="tool"`` observations.
* Shipped tools: :class:`PythonTool` (a sandboxed Python process forked by a warm
  fork server, or a persistent :class:`PythonSession` per episode; see
  :mod:`rl2gem.tools.python`), :class:`SearchTool` (a retrieval service) and
  :class:`FunctionTool` (any typed Python callable), and the tools of any MCP server
  (:class:`MCPServerTools`, :class:`MCPTool`).
* :func:`env_tools`: the tools an env gives its agent (what ``envserver --mcp`` serves).
"""

from rl2gem.tools.base import (
    Tool,
    ToolArgumentError,
    ToolCall,
    parse_tool_calls,
    tool_schema,
    tools_prompt,
    validate_arguments,
)
from rl2gem.tools.function import FunctionTool, json_schema_of
from rl2gem.tools.mcp import MCPServerTools, MCPTool
from rl2gem.tools.python import (
    ForkServerError,
    PythonSession,
    PythonTool,
    SandboxConfig,
    SandboxMode,
    SandboxResult,
    run_python,
    sandbox_mode,
    warm_up,
)
from rl2gem.tools.search import SearchTool
from rl2gem.tools.wrapper import ToolEnvWrapper, env_tools, format_tool_results, run_tool_calls

__all__ = [
    "Tool",
    "ToolCall",
    "ToolArgumentError",
    "parse_tool_calls",
    "tool_schema",
    "tools_prompt",
    "validate_arguments",
    "FunctionTool",
    "json_schema_of",
    "PythonTool",
    "PythonSession",
    "ForkServerError",
    "warm_up",
    "SandboxConfig",
    "SandboxMode",
    "SandboxResult",
    "run_python",
    "sandbox_mode",
    "SearchTool",
    "MCPServerTools",
    "MCPTool",
    "ToolEnvWrapper",
    "env_tools",
    "format_tool_results",
    "run_tool_calls",
]
