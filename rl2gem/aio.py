"""asyncio helpers shared by the HTTP clients (retrieval, engines) and servers."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

__all__ = ["LoopSessions", "read_json_object"]


class LoopSessions:
    """One ``aiohttp.ClientSession`` per event loop (a session cannot move between loops), so every
    coroutine of a loop shares one connection pool.

    A copy (``copy``, ``deepcopy``, ``pickle``) has the same settings and no session yet.

    Args:
        timeout: total seconds per request.
        limit: connections per session (0: unlimited).
    """

    def __init__(self, timeout: float, limit: int = 256):
        self.timeout, self.limit = timeout, limit
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    def __reduce__(self):
        return type(self), (self.timeout, self.limit)

    def get(self):
        """The running loop's session (created on first use or after it was closed)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), connector=aiohttp.TCPConnector(limit=self.limit)
            )
            self._sessions[loop] = session
        return session

    async def close(self) -> None:
        """Close the running loop's session."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None and not session.closed:
            await session.close()


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
