"""HTTP sessions per event loop: each is closed on its own loop, also when the loop ends first."""

import asyncio
import gc
import warnings

import gymnasium as gym
from aiohttp import web
from helpers import serving

import rl2gem  # noqa: F401  (registers the rl2/ envs)
from rl2gem.aio import LoopSessions


def echo_app() -> web.Application:
    async def ok(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    return app


def test_a_session_left_open_closes_when_its_loop_ends():
    """A client used from two ``asyncio.run`` calls (two notebook cells, two phases of a script)
    and closed in a third: the first two loops' sessions were left open ("Unclosed client
    session" at exit, their sockets with them). Each is now closed by its loop's end."""
    sessions = LoopSessions(timeout=10)
    opened = []

    async def fetch(url):
        session = sessions.get()
        opened.append(session)
        async with session.get(url) as response:
            return await response.text()

    with serving(echo_app()) as url, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(fetch(url)) == "ok" and asyncio.run(fetch(url)) == "ok"
        asyncio.run(sessions.close())
        gc.collect()
    assert len(opened) == 2 and all(session.closed for session in opened)
    assert not [w for w in caught if "Unclosed" in str(w.message)]


def test_the_sync_close_inside_the_loop_that_stepped_leaves_no_session_open(monkeypatch):
    """A Gymnasium user's ``env.close()`` inside the coroutine that awaited ``astep``: it ran on
    the env's private loop and closed that loop's session only."""
    opened, get = [], LoopSessions.get

    def recording(self):
        opened.append(get(self))
        return opened[-1]

    async def play():
        env = gym.make("rl2/SearchQA-v0", topk=1)
        await env.areset(seed=0)
        await env.astep("<search>Paris</search>")
        env.close()

    monkeypatch.setattr(LoopSessions, "get", recording)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(play())
        gc.collect()
    assert opened and all(session.closed for session in opened)
    assert not [w for w in caught if "Unclosed" in str(w.message)]
