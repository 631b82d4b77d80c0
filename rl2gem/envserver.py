"""``python -m rl2gem.envserver``: serve a registered env over OpenEnv's HTTP and WebSocket contract.

    python -m rl2gem.envserver rl2/GuessTheNumber-v0 --port 8000
    python -m rl2gem.envserver rl2/GSM8K-v0 --port 8001 split=test    # env kwargs as key=value (YAML values)
    python -m rl2gem.envserver rl2/SearchQA-v0 --mcp                   # its tools as an MCP server (stdio)
    python -m rl2gem.envserver rl2/PythonMath-v0 --mcp http --port 8002  # ... over Streamable HTTP at /mcp

Any registered env (built-in or plugin) with the kwargs given; the routes are
:mod:`rl2gem.serving.env_server`. Clients: ``gym.make("rl2/Remote-v0", url=...)``
(:class:`rl2gem.remote.RemoteEnv`), OpenEnv's WebSocket client, ``openenv validate URL``. It
prints ``RL2GEM_ENVSERVER_READY <url>`` once it listens. A bad env id or kwarg exits with 2 and
one line before anything listens.

``--mcp`` serves the env's tools instead (:mod:`rl2gem.serving.mcp_server`: a tool-wrapped env's
tools, SearchQA's search) as an MCP server: over stdin/stdout (``--mcp`` or ``--mcp stdio``, the
form MCP clients launch; the ready line then goes to stderr) or Streamable HTTP (``--mcp http``,
at ``http://HOST:PORT/mcp``). An env without tools exits with 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import gymnasium as gym
from omegaconf import OmegaConf

from rl2gem.procs import run_main, serve_app, serve_asgi
from rl2gem.registry import load_plugins
from rl2gem.serving.env_server import make_env_app
from rl2gem.serving.mcp_server import EnvToolbox, mcp_http_app, mcp_server, serve_mcp_stdio

__all__ = ["READY_PREFIX", "main"]

READY_PREFIX = "RL2GEM_ENVSERVER_READY"


def parse_env_kwargs(pairs: list[str]) -> dict:
    """``key=value`` arguments as env kwargs, values read as YAML (``n=3`` an int, ``a.b=1`` nested).

    Raises:
        ValueError: an argument that is not ``key=value``.
    """
    for pair in pairs:
        if "=" not in pair or pair.startswith("="):
            raise ValueError(f"env kwargs are key=value pairs, got {pair!r}")
    return OmegaConf.to_container(OmegaConf.from_dotlist(pairs), resolve=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl2gem.envserver", description=__doc__.split("\n\n")[0])
    p.add_argument("env_id", help="a registered env id, e.g. rl2/SearchQA-v0")
    p.add_argument("env_kwargs", nargs="*", help="the env's kwargs as key=value")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--max-sessions", type=int, default=256, help="sessions open at once (more get HTTP 503)")
    p.add_argument("--session-timeout", type=float, default=600.0, help="seconds idle before a session is closed")
    p.add_argument("--exit-on-stdin-eof", action="store_true", help="stop when stdin closes (used by launchers)")
    p.add_argument(
        "--mcp", nargs="?", const="stdio", choices=["stdio", "http"], help="serve the env's tools over MCP instead"
    )
    args = p.parse_intermixed_args(argv)  # options before or after the key=value pairs
    load_plugins()
    if args.mcp:
        return serve_tools(args)
    try:
        app = make_env_app(
            args.env_id,
            parse_env_kwargs(args.env_kwargs),
            max_sessions=args.max_sessions,
            session_timeout=args.session_timeout if args.session_timeout > 0 else None,
        )
    except (gym.error.Error, TypeError, ValueError, FileNotFoundError) as error:
        print(f"config error: {args.env_id}: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_app(app, args.host, args.port, READY_PREFIX, args.exit_on_stdin_eof))
    return 0


def serve_tools(args: argparse.Namespace) -> int:
    """``--mcp``: the env's tools as an MCP server until stdin closes (stdio) or it is stopped."""
    try:
        toolbox = EnvToolbox.of(args.env_id, parse_env_kwargs(args.env_kwargs))
    except (gym.error.Error, TypeError, ValueError, FileNotFoundError) as error:
        print(f"config error: {args.env_id}: {error}", file=sys.stderr)
        return 2
    if not toolbox.tools:
        print(f"config error: {args.env_id} has no tools to serve over MCP", file=sys.stderr)
        return 2
    server = mcp_server(toolbox, args.env_id)

    async def serve() -> None:
        try:
            if args.mcp == "stdio":
                print(f"{READY_PREFIX} stdio", file=sys.stderr, flush=True)
                await serve_mcp_stdio(server)
            else:
                app = mcp_http_app(server, args.host)
                await serve_asgi(app, args.host, args.port, READY_PREFIX, "/mcp", args.exit_on_stdin_eof)
        finally:
            await toolbox.aclose()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    run_main(main)
