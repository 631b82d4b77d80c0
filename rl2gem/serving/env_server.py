"""An env server: any registered env over OpenEnv's HTTP and WebSocket contract.

``python -m rl2gem.envserver ENV_ID`` (:mod:`rl2gem.envserver`) serves :func:`make_env_app`.
The routes follow OpenEnv's (meta-pytorch/OpenEnv, ``openenv-core`` 0.2: route names, the
``{observation, reward, done}`` envelope, the WebSocket messages, the fixed ``/health`` and
``/metadata`` answers), so ``openenv validate URL`` and OpenEnv's WebSocket client work against
it; the wire format of the observation and action is :mod:`rl2gem.env_protocol`.

=====================  ====================================================================
``POST /reset``        ``{seed?, options?, session_id?, env_kwargs?, request_id?}``: a new session
                       (or a new episode in ``session_id``), the env made with the served kwargs
                       updated by ``env_kwargs``; answers the envelope plus ``session_id`` (a
                       repeated ``request_id`` gets the answer it got while its session is open,
                       without a second reset: a client that lost the answer opens one session)
``POST /step``         ``{session_id, action: {message}, request_id?}``: one step of that session's
                       episode (a repeated ``request_id`` gets the answer it got, without a second
                       step: a client may retry a step whose answer it lost)
``GET /state``         ``?session_id=``: ``{episode_id, step_count, seed, done}``
``POST /close``        ``{session_id}``: ends the session and closes its env
``WS /ws``             one session per connection: ``{"type": "reset" | "step" | "state" | "close",
                       "data": {...}}``; answers ``{"type": "observation" | "state" | "error", "data"}``
``GET /health``        ``{"status": "healthy"}``
``GET /metadata``      ``{name, description, readme_content, version, author, documentation_url}``
``GET /schema``        :func:`rl2gem.env_protocol.env_schema` (``?env_kwargs=<JSON>``: of the env
                       a session with those kwargs gets, e.g. its split's ``num_items``)
``POST /mcp``          JSON-RPC 2.0: ``tools/list`` and ``tools/call`` of the env's tools
                       (:class:`rl2gem.serving.mcp_server.EnvToolbox`; OpenEnv's validator posts here)
``GET /openapi.json``  the routes, ``info.version`` 1.0.0 (what ``openenv validate`` reads)
=====================  ====================================================================

Unlike OpenEnv's HTTP routes, which build a fresh env for every call, ``/reset`` and ``/step``
keep an episode in a session, so plain HTTP clients (:class:`rl2gem.remote.RemoteEnv`) can
play one. Sessions: at most ``max_sessions`` at once (more: 503), closed after
``session_timeout`` seconds without a call. Every env call is awaited on the server's loop: an
async env's ``astep`` runs there, a compute-only env's in a worker thread (:class:`rl2gem.Env`),
so one slow episode never holds up the others. Bad input gets a 4xx with ``{"detail": message,
"code": ...}``: 400 (not JSON, a missing field), 404 (unknown session or route), 409 (a step
after the episode ended), 422 (an action that is not text, an unknown env kwarg), 503 (no
session free); an env that raises gets a 500 with the same body, and the server goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web
from gymnasium.error import ResetNeeded

import rl2gem
from rl2gem.aio import read_json_object
from rl2gem.env_protocol import ACTION_FIELD, env_schema, json_safe, reset_envelope, step_envelope
from rl2gem.registry import make
from rl2gem.serving.mcp_server import EnvToolbox

__all__ = ["SESSIONS", "EnvRoutes", "EnvSessions", "make_env_app"]

#: the MCP protocol version ``/mcp`` answers a client's ``initialize`` that names none
MCP_PROTOCOL_VERSION = "2025-06-18"

#: OpenEnv's HTTP API version (``openenv validate`` accepts 1.x).
API_VERSION = "1.0.0"


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, a machine-readable ``code`` and the message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class EnvSession:
    """One client's env and its episode."""

    id: str
    env: Any
    env_kwargs: dict[str, Any]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    episode_id: str | None = None
    seed: int | None = None
    steps: int = 0
    done: bool = False
    last_request: tuple[str, dict[str, Any]] | None = None  # (request_id, its answer)
    reapable: bool = True  # False: a WebSocket's, closed when its connection closes, never for idling


async def close_env(env: Any) -> None:
    """Close ``env`` (``aclose`` on this loop, else ``close`` in a worker thread); an env that fails
    to close is left behind, the server goes on."""
    with contextlib.suppress(Exception):
        if hasattr(env, "aclose"):
            await env.aclose()
        else:
            await asyncio.to_thread(env.close)


class EnvSessions:
    """The live sessions of a server: each an env made with ``env_kwargs`` (the served ones updated
    by the client's), at most ``max_sessions`` at once, closed after ``timeout`` idle seconds by
    :meth:`reap` (``None``: never).

    Raises (from :meth:`open`): :class:`RequestError` 503 when full, 422 when the env cannot be made
    with the kwargs.
    """

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any], max_sessions: int, timeout: float | None):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs)
        self.max_sessions, self.timeout = max_sessions, timeout
        self.sessions: dict[str, EnvSession] = {}
        self._opening = 0  # slots held by envs being made

    async def make_env(self, overrides: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        """An env of ``env_id`` with the served kwargs updated by ``overrides`` (made in a worker thread:
        a data-set env may read files), and those kwargs."""
        kwargs = {**self.env_kwargs, **dict(overrides or {})}
        try:
            return await asyncio.to_thread(make, self.env_id, **kwargs), kwargs
        except (TypeError, ValueError, KeyError, FileNotFoundError) as error:
            raise RequestError(422, "bad_env_kwargs", f"cannot make {self.env_id} with {kwargs}: {error}") from None

    async def _make_in_a_slot(self, overrides: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        """:meth:`make_env` in one of the ``max_sessions`` slots (503 when none is free)."""
        if len(self.sessions) + self._opening >= self.max_sessions:
            raise RequestError(
                503, "capacity_reached", f"server at capacity: {self.max_sessions} sessions open; close one or retry"
            )
        self._opening += 1
        try:
            return await self.make_env(overrides)
        finally:
            self._opening -= 1

    async def open(self, overrides: Mapping[str, Any] | None = None) -> EnvSession:
        """A new session with its own env (not reset)."""
        env, kwargs = await self._make_in_a_slot(overrides)
        session = EnvSession(uuid.uuid4().hex, env, kwargs)
        self.sessions[session.id] = session
        return session

    async def schema(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        """The schema of the env a session made with ``overrides`` gets (an env made for it in a
        slot, then closed)."""
        env, kwargs = await self._make_in_a_slot(overrides)
        try:
            return env_schema(self.env_id, env, kwargs)
        finally:
            await close_env(env)

    def get(self, session_id: Any) -> EnvSession:
        """The session ``session_id``, its idle clock restarted.

        Raises:
            RequestError: 400 without an id, 404 for an id with no live session.
        """
        if not isinstance(session_id, str) or not session_id:
            raise RequestError(
                400, "missing_session_id", "session_id is required: pass the one /reset answered (or use WS /ws)"
            )
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(
                404, "unknown_session", f"no open session {session_id!r} (closed, expired or never opened)"
            )
        session.last_used = time.monotonic()
        return session

    async def close(self, session_id: str) -> bool:
        """Close ``session_id``'s env; False when there was no such session."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        await close_env(session.env)
        return True

    async def reap(self) -> list[str]:
        """Close the sessions idle for more than ``timeout`` seconds (those mid-call are not idle); their ids."""
        if self.timeout is None:
            return []
        now = time.monotonic()
        idle = [
            s.id
            for s in self.sessions.values()
            if s.reapable and now - s.last_used > self.timeout and not s.lock.locked()
        ]
        for session_id in idle:
            await self.close(session_id)
        return idle

    async def close_all(self) -> None:
        for session_id in list(self.sessions):
            await self.close(session_id)


#: Where an env server application keeps its :class:`EnvSessions` (``app[SESSIONS]``).
SESSIONS = web.AppKey("sessions", EnvSessions)


def _error(error: RequestError) -> web.Response:
    return web.json_response({"detail": str(error), "code": error.code}, status=error.status)


def _action_text(action: Any) -> str:
    """The text of an action object ``{"message": str}`` (a bare string is accepted too)."""
    if isinstance(action, Mapping):
        action = action.get(ACTION_FIELD)
    if not isinstance(action, str):
        raise RequestError(
            422, "bad_action", f'the action must be text: {{"{ACTION_FIELD}": "..."}}, got {action!r:.200}'
        )
    return action


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise RequestError(422, "bad_seed", f"seed must be a non-negative integer or null, got {seed!r}")
    return seed


def _mapping(body: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = body.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise RequestError(422, f"bad_{key}", f"{key} must be an object, got {value!r:.200}")
    return None if value is None else dict(value)


class _Shared:
    """Results of coroutines by key, the newest ``size`` kept: the first call of a key runs, the
    calls after it share that run (while it runs too); one that failed, or whose result ``stale``
    rejects, runs again."""

    def __init__(self, size: int):
        self.size = size
        self._runs: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()

    async def run(self, key: str, start: Callable[[], Awaitable[Any]], stale: Callable[[Any], bool] = lambda _: False):
        """``start()``'s result, or that of the run already made for ``key``. A caller that is
        cancelled (a client that hung up) does not stop the run."""
        run = self._runs.get(key)
        if run is None or (run.done() and (run.cancelled() or run.exception() is not None or stale(run.result()))):
            run = self._runs[key] = asyncio.ensure_future(start())
            run.add_done_callback(lambda done: done.cancelled() or done.exception())  # its error read, if no one waits
            while len(self._runs) > self.size:
                self._runs.popitem(last=False)
        return await asyncio.shield(run)


class EnvRoutes:
    """The routes of an env server (see the module docstring), one method per route.

    Args:
        sessions: the server's :class:`EnvSessions`.
        schema: what ``/schema`` answers (:func:`rl2gem.env_protocol.env_schema`).
        description: ``/metadata``'s description.
        toolbox: the env's tools (``/mcp``).
    """

    def __init__(self, sessions: EnvSessions, schema: dict[str, Any], description: str, toolbox: EnvToolbox):
        self.sessions, self.schema, self.description, self.toolbox = sessions, schema, description, toolbox
        self._resets = _Shared(1024)  # by request id: retries whose answer was lost
        self._schemas = _Shared(64)  # by env_kwargs

    def table(self) -> list[web.RouteDef]:
        return [
            web.post("/reset", self.reset),
            web.post("/step", self.step),
            web.get("/state", self.state),
            web.post("/close", self.close),
            web.get("/ws", self.websocket),
            web.get("/health", self.health),
            web.get("/metadata", self.metadata),
            web.get("/schema", self.schema_route),
            web.post("/mcp", self.mcp),
            web.get("/openapi.json", self.openapi),
        ]

    # ------------------------------------------------------------ episodes
    async def start_episode(self, session: EnvSession | None, body: Mapping[str, Any]) -> tuple[EnvSession, dict]:
        """Reset ``session`` (a new one when None) for a new episode; the session and the envelope."""
        seed, options, overrides = _seed(body), _mapping(body, "options"), _mapping(body, "env_kwargs")
        if session is None:  # a new session that fails its first reset is closed: the client never got its id
            session = await self.sessions.open(overrides)
            try:
                return await self._reset_session(session, body, seed, options, overrides)
            except BaseException:
                await self.sessions.close(session.id)
                raise
        return await self._reset_session(session, body, seed, options, overrides)

    async def _reset_session(self, session: EnvSession, body, seed, options, overrides) -> tuple[EnvSession, dict]:
        async with session.lock:
            if overrides is not None and {**self.sessions.env_kwargs, **overrides} != session.env_kwargs:
                old = session.env
                session.env, session.env_kwargs = await self.sessions.make_env(overrides)
                await close_env(old)
            try:
                observation, info = await session.env.areset(seed=seed, options=options)
            except (ValueError, IndexError, KeyError) as error:  # e.g. an options index out of range
                raise RequestError(422, "bad_reset", f"reset refused: {error}") from None
            session.episode_id = str(body.get("episode_id") or uuid.uuid4().hex)
            session.seed, session.steps, session.done, session.last_request = info.get("seed"), 0, False, None
        return session, reset_envelope(observation, info)

    async def take_step(self, session: EnvSession, action: Any, request_id: Any = None) -> dict[str, Any]:
        """One step of ``session``'s episode; its envelope."""
        text = _action_text(action)
        async with session.lock:
            if request_id is not None and session.last_request and session.last_request[0] == request_id:
                return session.last_request[1]  # a retry of the step just taken
            if session.episode_id is None or session.done:
                raise RequestError(409, "episode_over", "the episode has ended (or never started): POST /reset first")
            try:
                result = await session.env.astep(text)
            except ResetNeeded as error:
                raise RequestError(409, "episode_over", str(error)) from None
            session.steps += 1
            session.done = bool(result[2] or result[3])
            envelope = step_envelope(*result)
            if request_id is not None:
                session.last_request = (request_id, envelope)
        return envelope

    def state_of(self, session: EnvSession) -> dict[str, Any]:
        return {
            "episode_id": session.episode_id,
            "step_count": session.steps,
            "seed": session.seed,
            "done": session.done,
        }

    # --------------------------------------------------------- HTTP routes
    async def _body(self, request) -> dict[str, Any]:
        try:
            return await read_json_object(request, allow_empty=True)
        except ValueError as error:
            raise RequestError(400, "bad_json", str(error)) from None

    async def reset(self, request):
        try:
            body = await self._body(request)
            session = self.sessions.get(body["session_id"]) if body.get("session_id") is not None else None
            answer = await self._reset_once(session, body)
        except RequestError as error:
            return _error(error)
        return web.json_response(answer)

    async def _reset_once(self, session: EnvSession | None, body: Mapping[str, Any]) -> dict[str, Any]:
        """The answer to a reset of ``session`` (a new one when None); a retry with the same
        ``request_id`` gets the first try's answer (awaiting it if it is still running) while that
        session is open, so the env is not reset again (nor a second session opened)."""
        request_id = body.get("request_id")

        async def run() -> dict[str, Any]:
            started, envelope = await self.start_episode(session, body)
            return {**envelope, "session_id": started.id, "episode_id": started.episode_id}

        if not isinstance(request_id, str) or not request_id:
            return await run()
        return await self._resets.run(
            request_id, run, stale=lambda answer: answer["session_id"] not in self.sessions.sessions
        )

    async def step(self, request):
        try:
            body = await self._body(request)
            session = self.sessions.get(body.get("session_id"))
            if "action" not in body:
                raise RequestError(400, "missing_action", f'the body needs "action": {{"{ACTION_FIELD}": "..."}}')
            return web.json_response(await self.take_step(session, body["action"], body.get("request_id")))
        except RequestError as error:
            return _error(error)

    async def state(self, request):
        try:
            return web.json_response(self.state_of(self.sessions.get(request.query.get("session_id"))))
        except RequestError as error:
            return _error(error)

    async def close(self, request):
        try:
            body = await self._body(request)
            session = self.sessions.get(body.get("session_id"))
        except RequestError as error:
            return _error(error)
        await self.sessions.close(session.id)
        return web.json_response({"session_id": session.id, "closed": True})

    async def health(self, request):
        return web.json_response({"status": "healthy"})

    async def metadata(self, request):
        return web.json_response(
            {
                "name": self.sessions.env_id,
                "description": self.description,
                "readme_content": None,
                "version": rl2gem.__version__,
                "author": "rl2gem",
                "documentation_url": None,
            }
        )

    async def schema_route(self, request):
        """The served env's schema; with ``?env_kwargs=<JSON object>``, that of the env a session
        made with those kwargs gets (its data split's ``num_items``, its ``max_turns``)."""
        text = request.query.get("env_kwargs")
        if text is None:
            return web.json_response(self.schema)
        try:
            overrides = json.loads(text)
            if not isinstance(overrides, dict):
                raise ValueError("not an object")
        except ValueError as error:
            return _error(RequestError(400, "bad_env_kwargs", f"env_kwargs must be a JSON object: {error}"))
        try:  # concurrent first resets with the same kwargs share one build
            schema = await self._schemas.run(
                json.dumps(overrides, sort_keys=True), lambda: self.sessions.schema(overrides)
            )
        except RequestError as error:
            return _error(error)
        return web.json_response(schema)

    async def openapi(self, request):
        paths: dict[str, dict[str, Any]] = {}
        for route in self.table():
            paths.setdefault(route.path, {})[route.method.lower()] = {"summary": route.handler.__name__}
        info = {"title": f"rl2gem env server: {self.sessions.env_id}", "version": API_VERSION}
        return web.json_response({"openapi": "3.1.0", "info": info, "paths": paths})

    async def mcp(self, request):
        """JSON-RPC 2.0, always HTTP 200 (OpenEnv's convention): ``tools/list`` answers the env's
        tools, ``tools/call`` (``{name, arguments}``) runs one (``{content: [{type: text, text}],
        isError}``); other methods -32601, params that are not an object -32602. An MCP client's
        Streamable HTTP handshake works too (JSON answers, no session id): ``initialize`` (the
        client's protocol version, the tools capability), ``ping``, and a notification (no ``id``:
        202, no body)."""
        try:
            message = json.loads(await request.text())
        except ValueError:
            return _rpc_error(None, -32700, "Parse error")
        if (
            not isinstance(message, dict)
            or message.get("jsonrpc") != "2.0"
            or not isinstance(message.get("method"), str)
        ):
            return _rpc_error(None, -32600, "Invalid request: needs jsonrpc '2.0' and a method")
        method, params, rpc_id = message["method"], message.get("params") or {}, message.get("id")
        if not isinstance(params, dict):
            return _rpc_error(rpc_id, -32602, "params must be an object")
        if "id" not in message and method.startswith("notifications/"):  # notifications/initialized...
            return web.Response(status=202)
        if method == "initialize":
            result: dict[str, Any] = {
                "protocolVersion": str(params.get("protocolVersion") or MCP_PROTOCOL_VERSION),
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "rl2gem-envserver", "version": rl2gem.__version__},
            }
        elif method == "ping":
            result = {}
        elif method == "tools/list":
            result = {"tools": self.toolbox.listing()}
        elif method == "tools/call":
            text, is_error = await self.toolbox.call(str(params.get("name", "")), params.get("arguments"))
            result = {"content": [{"type": "text", "text": text}], "isError": is_error}
        else:
            return _rpc_error(rpc_id, -32601, f"Method not found: {method}")
        return web.json_response({"jsonrpc": "2.0", "id": rpc_id, "result": result})

    # ------------------------------------------------------------ WebSocket
    async def websocket(self, request):
        """One session per connection (OpenEnv's ``/ws``): made at connect, closed at disconnect."""
        socket = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await socket.prepare(request)
        try:
            session = await self.sessions.open()
        except RequestError as error:
            await socket.send_json({"type": "error", "data": {"message": str(error), "code": error.code.upper()}})
            await socket.close()
            return socket
        session.reapable = False  # an idle connection keeps its env (the reaper closed it under the handler)
        try:
            async for frame in socket:
                if frame.type != WSMsgType.TEXT:
                    break
                reply = await self._websocket_reply(session, frame.data)
                if reply is None:
                    break
                await socket.send_json(reply)
        finally:
            await self.sessions.close(session.id)
            await socket.close()
        return socket

    async def _websocket_reply(self, session: EnvSession, text: str) -> dict[str, Any] | None:
        """The answer to one WebSocket message (None: the client closed the session)."""
        try:
            message = json.loads(text)
        except ValueError:
            return {"type": "error", "data": {"message": "the message is not JSON", "code": "INVALID_JSON"}}
        kind = message.get("type") if isinstance(message, dict) else None
        data = message.get("data") if isinstance(message, dict) else None
        session.last_used = time.monotonic()
        try:
            if kind == "reset":
                _, envelope = await self.start_episode(session, data if isinstance(data, Mapping) else {})
                return {"type": "observation", "data": envelope}
            if kind == "step":
                return {"type": "observation", "data": await self.take_step(session, data)}
            if kind == "state":
                return {"type": "state", "data": self.state_of(session)}
            if kind == "close":
                return None
        except RequestError as error:
            code = "VALIDATION_ERROR" if error.status in (400, 422) else "EXECUTION_ERROR"
            return {"type": "error", "data": {"message": str(error), "code": code}}
        except Exception as error:  # the env raised: the connection and the server go on
            return {"type": "error", "data": {"message": f"{type(error).__name__}: {error}", "code": "EXECUTION_ERROR"}}
        message = f"unknown message type {kind!r}: reset, step, state or close"
        return {"type": "error", "data": {"message": message, "code": "UNKNOWN_TYPE"}}


@web.middleware
async def _json_errors(request, handler):
    """aiohttp's own refusals (unknown route, wrong method) and an env's exception as JSON bodies."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        body = {"detail": f"{request.method} {request.path}: {error.reason}", "code": f"http_{error.status}"}
        allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
        return web.json_response(body, status=error.status, headers=allow)
    except Exception as error:  # the env raised
        body = {"detail": f"the env raised {type(error).__name__}: {error}", "code": "env_error"}
        return web.json_response(json_safe(body), status=500)


def _rpc_error(rpc_id: Any, code: int, message: str) -> web.Response:
    return web.json_response({"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}})


def make_env_app(
    env_id: str,
    env_kwargs: Mapping[str, Any] | None = None,
    *,
    max_sessions: int = 256,
    session_timeout: float | None = 600.0,
) -> web.Application:
    """The aiohttp application serving ``env_id`` (made with ``env_kwargs``).

    One env is made (and closed) here first, so an unknown id or a bad kwarg fails before the
    server listens.

    Raises:
        gymnasium.error.Error: unknown env id.
        TypeError, ValueError: the env cannot be made with ``env_kwargs``.
    """
    env_kwargs = dict(env_kwargs or {})
    probe = make(env_id, **env_kwargs)  # kept for its tools (/mcp), closed with the app
    try:
        schema = env_schema(env_id, probe, env_kwargs)
        description = (type(probe.unwrapped).__doc__ or env_id).strip().splitlines()[0]
        toolbox = EnvToolbox(probe)
    except BaseException:
        probe.close()
        raise
    sessions = EnvSessions(env_id, env_kwargs, max_sessions, session_timeout)
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[_json_errors])
    app[SESSIONS] = sessions
    app.add_routes(EnvRoutes(sessions, schema, description, toolbox).table())

    async def reaper(app):
        async def loop():
            while True:
                await asyncio.sleep(max(1.0, (session_timeout or 60.0) / 4))
                await sessions.reap()

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sessions.close_all()
        await toolbox.aclose()

    app.cleanup_ctx.append(reaper)
    return app
