"""SearchTool over the embedded BM25 service and a dead URL."""

import asyncio
import socket

from rl2gem.retrieval import EmbeddedService
from rl2gem.tools import SearchTool


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
