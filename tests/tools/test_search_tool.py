"""SearchTool over the embedded BM25 service and a dead URL."""

import asyncio
import socket
import time

import gymnasium as gym
import rl2gem.envs  # noqa: F401  (registers the envs)

from rl2gem.retrieval import EmbeddedService
from rl2gem.tools import SearchTool, ToolEnvWrapper


def test_embedded_search_returns_passages_and_releases_the_service():
    async def main():
        tool = SearchTool(topk=2)
        text = await tool.call({"query": "Eiffel Tower Paris"})
        empty = await tool.call({"query": "  "})
        users = EmbeddedService._users
        await tool.aclose()
        return text, empty, users

    text, empty, users = asyncio.run(main())
    assert text.startswith("Doc 1 (Title:") and "Doc 2 (Title:" in text and "Doc 3" not in text
    assert "Paris" in text or "Eiffel" in text
    assert empty == "Error: the query is empty." and users >= 1
    assert EmbeddedService._users == 0


def test_dead_service_is_reported_as_text():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tool = SearchTool(f"http://127.0.0.1:{port}", retries=0, timeout=2)
    text = asyncio.run(tool.call({"query": "anything"}))
    assert text.startswith("Search failed")


def test_closing_an_env_spawned_from_a_search_env_leaves_the_shared_tool_open():
    """The envs ``ToolEnvWrapper.spawn`` makes share the wrapper's tools: closing one closes only
    its own event loop's session; it released the embedded service the others searched with
    (started again on their next search) and orphaned their sessions. The wrapper they came from
    releases it."""
    env = ToolEnvWrapper(gym.make("rl2/GuessTheNumber-v0", difficulty="easy"), [SearchTool()])
    env.reset(seed=0)
    call = '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>'
    assert env.step(call)[0].startswith("Doc 1")
    users, service = EmbeddedService._users, EmbeddedService._service
    kids, _, _ = env.spawn(2)
    assert kids[0].step(call)[0].startswith("Doc 1") and kids[1].step(call)[0].startswith("Doc 1")
    kids[0].close()
    assert (EmbeddedService._users, EmbeddedService._service) == (users, service)
    assert kids[1].step(call)[0].startswith("Doc 1") and EmbeddedService._service is service
    retrieval = env.tools["search"]._retrieval
    env.close()  # before the last spawned env, which closes its own loop's session after
    assert EmbeddedService._users == users - 1
    kids[1].close()
    assert retrieval._retired and all(not client._sessions._sessions for client in retrieval._retired)


def test_concurrent_first_searches_share_one_client_and_one_hold_on_the_service(monkeypatch):
    """Concurrent first calls each acquired the embedded service and made a client; aclose released
    one: the BM25 service outlived every env and the other clients' sessions leaked."""
    from rl2gem.retrieval import LazyRetrieval

    users = []

    def acquire(cls, startup_timeout=120.0):
        time.sleep(0.05)  # the calls overlap here
        users.append(1)
        return "http://127.0.0.1:9"

    monkeypatch.setattr(EmbeddedService, "acquire", classmethod(acquire))
    monkeypatch.setattr(EmbeddedService, "release", classmethod(lambda cls: users.pop()))
    lazy = LazyRetrieval(None)

    async def main():
        clients = await asyncio.gather(*(lazy.client() for _ in range(4)))
        assert len({id(client) for client in clients}) == 1 and len(users) == 1
        await lazy.aclose()

    asyncio.run(main())
    assert users == []  # every hold released
