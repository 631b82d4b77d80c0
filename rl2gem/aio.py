"""asyncio helpers shared by the HTTP clients (retrieval, engines) and servers."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["LoopSessions", "read_json_object", "run_coroutine"]


class LoopSessions:
    """One ``aiohttp.ClientSession`` per event loop (a session cannot move between loops), so every
    coroutine of a loop shares one connection pool.

    A session is closed by :meth:`close` on its loop, or else when its loop shuts down its async
    generators (``asyncio.run`` does, at its end; so does an env's private loop): a session left
    open on a loop that ended (an env used from two ``asyncio.run`` calls, or closed with the sync
    ``close()`` from inside the loop it stepped on) no longer warns "Unclosed client session".

    A copy (``copy``, ``deepcopy``, ``pickle``) has the same settings and no session yet.

    Args:
        timeout: total seconds per request.
        limit: connections per session (0: unlimited).
    """

    def __init__(self, timeout: float, limit: int = 256):
        self.timeout, self.limit = timeout, limit
        # loop -> (session, the async generator that closes it when the loop shuts its generators down)
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    def __reduce__(self):
        return type(self), (self.timeout, self.limit)

    def get(self):
        """The running loop's session (created on first use or after it was closed)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        session, _ = self._sessions.get(loop, (None, None))
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), connector=aiohttp.TCPConnector(limit=self.limit)
            )
            guard = _closed_at_loop_end(session)
            # __anext__ registers the generator with the loop (its asyncgen hooks); the task runs it to its yield
            asyncio.ensure_future(guard.__anext__())
            self._sessions[loop] = (session, guard)
        return session

    async def close(self) -> None:
        """Close the running loop's session."""
        session, guard = self._sessions.pop(asyncio.get_running_loop(), (None, None))
        if session is not None and not session.closed:
            await session.close()
        if guard is not None:
            await guard.aclose()


async def _closed_at_loop_end(session):
    """Suspended at its ``yield`` for the life of ``session``'s loop; the loop's
    ``shutdown_asyncgens`` (or :meth:`LoopSessions.close`) closes it, and with it the session."""
    try:
        yield
    finally:
        if not session.closed:
            await session.close()


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)``, also from code that runs inside an event loop (a Jupyter cell,
    an async application), where ``asyncio.run`` refuses: there it runs in a thread of its own,
    on a new loop, while the caller waits."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="rl2gem-run") as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def read_json_object(request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The JSON object in an aiohttp request's body.

    Args:
        allow_empty: a request without a body reads as ``{}``.

    Raises:
        ValueError: the body is not JSON, or not a JSON object.
    """
    if allow_empty and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except Exception as e:
        raise ValueError(f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body
