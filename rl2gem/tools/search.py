"""A search tool over a Search-R1 compatible retrieval service."""

from __future__ import annotations

from typing import Any

from rl2gem.retrieval import LazyRetrieval, RetrievalError, format_passages

__all__ = ["SearchTool"]


class SearchTool:
    """A :class:`rl2gem.tools.Tool` that searches a retrieval service (``POST /retrieve``).

    Arguments: ``{"query": str}``. The result is the top-``topk`` passages,
    numbered (``Doc 1 (Title: ...) ...``); a failed search (service down,
    timeout after ``retries``) is returned as text saying so.

    Args:
        url: a Search-R1 compatible service; ``None`` starts (on first call) the
            embedded BM25 service over the Wikipedia summaries that
            ``rl2/SearchQA-v0`` uses, shared by every user in the process;
            :meth:`close` releases it.
        topk: passages per search (1..100).
        timeout, retries: per search.
        name: the tool name the model calls (default ``"search"``).

    Raises:
        ValueError: ``topk`` outside 1..100.
    """

    description = "Search an encyclopedia and get the most relevant passages."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to search for, in a few words."}},
        "required": ["query"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        url: str | None = None,
        *,
        topk: int = 3,
        timeout: float = 10.0,
        retries: int = 2,
        name: str = "search",
        instructions: str = "",
    ):
        if not 1 <= topk <= 100:
            raise ValueError(f"topk must be 1..100, got {topk}")
        self.url, self.topk, self.timeout, self.retries = url, topk, timeout, retries
        self.name, self.instructions = name, instructions
        self._retrieval = LazyRetrieval(url, timeout=timeout, retries=retries)

    async def call(self, arguments: dict[str, Any]) -> str:
        query = str(arguments.get("query", "")).strip()
        if not query:
            return "Error: the query is empty."
        try:
            hits = (await (await self._retrieval.client()).retrieve([query], self.topk))[0]
        except RetrievalError as e:
            return f"Search failed ({e}). You can search again."
        return format_passages(hits) if hits else "No results."

    async def aclose(self) -> None:
        """Close the HTTP sessions and release the embedded service."""
        await self._retrieval.aclose()

    async def aclose_loop(self) -> None:
        """Close the running event loop's HTTP session only (an env sharing this tool closes)."""
        await self._retrieval.aclose_loop()

    def __repr__(self) -> str:
        return f"SearchTool({self.url or 'embedded BM25'}, topk={self.topk})"
