"""asyncio helpers shared by the HTTP clients (retrieval, engines)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

__all__ = ["LoopSessions"]


class LoopSessions:
    """One ``aiohttp.ClientSession`` per event loop (a session cannot move between loops), so every
    coroutine of a loop shares one connection pool.

    Args:
        timeout: total seconds per request.
        limit: connections per session (0: unlimited).
    """

    def __init__(self, timeout: float, limit: int = 256):
        self.timeout, self.limit = timeout, limit
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

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
