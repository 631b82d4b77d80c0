"""Client of SGLang's native HTTP API: our embedded server, SGLang servers, or a router.

``HTTPEngine(url, workers=[...])``: ``generate`` goes to ``url`` (a server, or an
sglang-router that balances over ``workers``); pause / continue / abort /
weight updates go to every worker directly, because the router does not
forward them. With no ``workers`` the URL is the only worker.

Failures: a connection error, a timeout or a 5xx answer is retried
(``retries`` times, exponential backoff), which is how a request that was
routed to a worker that died is served by another one once the router has
dropped it. A ``/generate`` that timed out is aborted on every worker (by its
request id, best effort) before it is sent again under a new id, so a slow
generation is not left running beside its copy. A 4xx answer raises
``ValueError`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl2gem.aio import LoopSessions
from rl2gem.rollout.engines.base import Engine, EngineError, GenerateOutput, SamplingParams

__all__ = ["HTTPEngine", "parse_generate_response", "served_context_length"]


def served_context_length(url: str) -> int | None:
    """The context length ``url``'s ``/get_server_info`` reports (ours and SGLang's), else None
    (blocking; called before a run starts)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/get_server_info", timeout=30) as answer:
            value = json.loads(answer.read().decode()).get("context_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def parse_generate_response(
    body: Mapping[str, Any], prompt_tokens: int | None = None, weight_version: int = 0
) -> GenerateOutput:
    """A ``/generate`` answer (SGLang's format) as a :class:`GenerateOutput`; ``weight_version`` is
    the version of an answer whose ``meta_info`` has no integer ``weight_version`` (a server that
    does not report one, or names versions: the sender's version, not 0, which would make every
    token look stale once the engine's version passed ``max_staleness``).

    Raises:
        EngineError: the answer lacks ``output_ids`` / ``meta_info``.
    """
    try:
        meta = body["meta_info"]
        ids = [int(t) for t in body["output_ids"]]
    except (KeyError, TypeError) as e:
        raise EngineError(f"malformed /generate answer (missing {e}): {str(body)[:200]}") from None
    lps = meta.get("output_token_logprobs")
    logprobs = [float(x[0]) for x in lps] if lps else [0.0] * len(ids)
    if len(logprobs) != len(ids):
        raise EngineError(f"/generate answered {len(ids)} ids but {len(logprobs)} logprobs")
    inp = meta.get("input_token_logprobs")
    finish = meta.get("finish_reason") or {"type": "stop"}
    if isinstance(finish, str):
        finish = {"type": finish}
    version = meta.get("weight_version", weight_version)
    try:
        version = int(version)
    except (TypeError, ValueError):
        version = weight_version
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=dict(finish),
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens or 0)),
        weight_version=version,
        input_logprobs=[None if x[0] is None else float(x[0]) for x in inp] if inp else None,
        meta={k: meta[k] for k in ("id", "e2e_latency", "cached_tokens") if k in meta},
    )


class _TimedOut(EngineError):
    """An attempt that got no answer within the timeout (its request may still be running)."""


class HTTPEngine(Engine):
    """SGLang-API client (see module docstring).

    Args:
        url: where ``/generate`` goes (server or router).
        workers: the engine servers behind ``url`` (for control calls).
        timeout: seconds per request attempt.
        retries: extra attempts on connection errors / 5xx.
        backoff: first retry delay in seconds (doubles).
    """

    def __init__(
        self,
        url: str,
        workers: list[str] | None = None,
        *,
        timeout: float = 600.0,
        retries: int = 5,
        backoff: float = 0.25,
    ):
        self.url = url.rstrip("/")
        self.workers = [w.rstrip("/") for w in (workers or [self.url])]
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.weight_version = 0
        self.context_length: int | None = None  # the served model's, where known (python -m rl2gem.serve sets it)
        self.retried = 0
        self.lora_name: str | None = None  # the adapter every request names (update_lora_adapter)
        self._sessions = LoopSessions(timeout, limit=0)
        self._attempt_rids: dict[str, str] = {}  # a generate's request id -> its current attempt's
        self._tasks: set[asyncio.Task] = set()

    def _session(self):
        return self._sessions.get()

    async def _call(self, method: str, url: str, payload: Any = None, *, retry: bool = True, on_timeout=None) -> Any:
        """One call's answer (JSON or text), retried on no answer or a 5xx.

        ``on_timeout``: called after an attempt timed out, before the next is sent.

        Raises:
            ValueError: a 4xx answer (not retried).
            EngineError: no good answer after the retries.
        """
        import aiohttp

        delay = self.backoff
        attempts = 1 + (self.retries if retry else 0)
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt and on_timeout is not None and isinstance(last, _TimedOut):
                on_timeout()
            try:
                async with self._session().request(method, url, json=payload) as r:
                    if r.status >= 500:
                        last = EngineError(f"{method} {url}: HTTP {r.status}: {(await r.text())[:300]}")
                    elif r.status >= 400:
                        text = await r.text()
                        raise ValueError(f"{method} {url}: HTTP {r.status}: {text[:500]}")
                    else:
                        ctype = r.headers.get("Content-Type", "")
                        return await r.json() if "json" in ctype else await r.text()
            except asyncio.TimeoutError as e:
                last = _TimedOut(f"{method} {url}: no answer within {self.timeout:g} s ({type(e).__name__})")
            except (aiohttp.ClientError, ConnectionError) as e:
                last = EngineError(f"{method} {url}: {type(e).__name__}: {e}")
            if attempt + 1 < attempts:
                self.retried += 1
                await asyncio.sleep(delay)
                delay *= 2
        raise last  # type: ignore[misc]

    async def generate(self, input_ids, sampling_params=None, *, return_logprob=True, logprob_start_len=-1, rid=None):
        params = SamplingParams.from_dict(sampling_params)
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty")
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": params.to_dict(),
            "return_logprob": bool(return_logprob),
        }
        if return_logprob:
            payload["logprob_start_len"] = int(logprob_start_len)
        base = rid if rid is not None else uuid.uuid4().hex
        payload["rid"] = base
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        self._attempt_rids[base] = base
        version = self.weight_version  # update_weights pauses and aborts first: what this request runs

        def abort_timed_out():  # the timed-out copy may still run: stop it, re-send under a new id
            self._background(self._abort_quietly(payload["rid"]))  # a hung worker does not delay the retry
            # a fresh id, no prefix of another's: SGLang aborts every request whose id starts with the given one
            payload["rid"] = self._attempt_rids[base] = uuid.uuid4().hex

        try:
            body = await self._call("POST", self.url + "/generate", payload, on_timeout=abort_timed_out)
        finally:
            self._attempt_rids.pop(base, None)
        return parse_generate_response(body, len(ids), version)

    async def _abort_quietly(self, rid: str) -> None:
        with contextlib.suppress(EngineError, ValueError):
            await self._all("POST", "/abort_request", {"rid": rid})

    def _background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._tasks.discard)

    async def _all(self, method: str, path: str, payload: Any = None) -> list[Any]:
        return list(await asyncio.gather(*(self._call(method, w + path, payload, retry=False) for w in self.workers)))

    async def pause(self, mode: str = "abort") -> None:
        await self._all("POST", "/pause_generation", {"mode": mode})
        self._paused = True

    async def resume(self) -> None:
        await self._all("POST", "/continue_generation", {})
        self._paused = False

    async def abort(self, rid: str | None = None) -> None:
        if rid is not None:
            rid = self._attempt_rids.get(rid, rid)  # the id the request's current attempt runs under
        await self._all("POST", "/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache")

    async def update_weights(self, weights, version: int | None = None) -> int:
        """Weights from a folder (``update_weights_from_disk`` on every worker), or a
        state dict saved to a temporary safetensors folder first (the folder must
        be visible to the workers: same machine or shared disk)."""
        new_version = self.weight_version + 1 if version is None else int(version)
        if isinstance(weights, (str, Path)):
            await self._update_from_disk(str(weights), new_version)
        else:
            from safetensors.torch import save_file

            items = dict(weights.items() if isinstance(weights, Mapping) else weights)
            with tempfile.TemporaryDirectory(prefix="rl2gem-weights-") as d:
                tensors, seen = {}, set()
                for k, v in items.items():  # tied weights (embeddings = lm_head) are saved once
                    key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
                    if key in seen:
                        continue
                    seen.add(key)
                    tensors[k] = v.detach().to("cpu").contiguous()
                await asyncio.to_thread(save_file, tensors, os.path.join(d, "model.safetensors"))
                await self._update_from_disk(d, new_version)
        self.weight_version = new_version
        return new_version

    async def update_lora_adapter(self, path: str | Path, version: int | None = None) -> int:
        """Adapter-only weight sync: every worker unloads the previous adapter
        (``/unload_lora_adapter``) and loads the one in ``path`` (peft's format, e.g. a LoRA run's
        ``checkpoint-<step>/hf/adapter``) as ``rl2gem-v<version>`` (``/load_lora_adapter``); from
        then on every request names it (``lora_path``). The base weights stay. SGLang servers
        need ``--enable-lora --max-lora-rank R --lora-target-modules ...`` at launch; ``path``
        must be visible to them. Returns the new weight version.

        Raises:
            EngineError: a worker refused the adapter.
        """
        new_version = self.weight_version + 1 if version is None else int(version)
        name = f"rl2gem-v{new_version}"
        if self.lora_name is not None:
            await self._all("POST", "/unload_lora_adapter", {"lora_name": self.lora_name})
            self.lora_name = None
        res = await self._all("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        bad = [r for r in res if isinstance(r, dict) and not r.get("success", True)]
        if bad:
            raise EngineError(f"load_lora_adapter failed: {bad[0].get('message')}")
        self.lora_name, self.weight_version = name, new_version
        return new_version

    async def _update_from_disk(self, path: str, version: int) -> None:
        res = await self._all("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        bad = [r for r in res if isinstance(r, dict) and not r.get("success", True)]
        if bad:
            raise EngineError(f"update_weights_from_disk failed: {bad[0].get('message')}")

    async def health(self) -> bool:
        try:
            await self._call("GET", self.url + "/health", retry=False)
            return True
        except (EngineError, ValueError):
            return False

    async def get_load(self) -> list[dict[str, Any]]:
        """Each worker's ``/get_load`` answer (SGLang's list format), in worker order."""
        return await self._all("GET", "/get_load")

    async def close(self) -> None:
        if self._tasks:  # aborts still on their way
            await asyncio.wait(list(self._tasks), timeout=5)
        await self._sessions.close()
