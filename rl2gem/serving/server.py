"""HTTP server for the embedded engine, speaking SGLang's native API.

``python -m rl2gem.serve --model smollm2-135m-instruct --port 30000`` (the command line,
:mod:`rl2gem.serve`; :func:`launch` starts it as a child process) serves
:class:`~rl2gem.rollout.engines.embedded.EmbeddedEngine` with the subset of
SGLang's HTTP API that RL needs, so the same client
(:class:`~rl2gem.rollout.engines.http.HTTPEngine`) and the real
``sglang-router`` work in front of it or of real SGLang servers:

==============================  ==========================================================
``POST /generate``              ``input_ids`` (one list, or a batch of lists), ``sampling_params``
                                (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
                                ``stop_token_ids``, ``ignore_eos``, ``no_stop_trim``),
                                ``return_logprob``, ``logprob_start_len``, ``rid``; answers
                                ``text``, ``output_ids`` and ``meta_info`` (``id``,
                                ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
                                ``output_token_logprobs`` as ``[logprob, token_id, null]``,
                                ``weight_version``, ``e2e_latency``)
``GET /health``                 200 while the engine runs (``/health_generate`` too)
``GET /get_load``               ``[{"dp_rank": 0, "num_reqs": .., "num_waiting_reqs": .., "num_tokens": ..}]``
``GET /get_model_info``         ``model_path``, ``tokenizer_path``, ``is_generation``, ``weight_version``
``GET /get_server_info``        limits and engine counters
``POST /pause_generation``      ``{"mode": "abort" | "in_place"}``
``POST /continue_generation``
``POST /abort_request``         ``{"rid": ..}`` or ``{"abort_all": true}``
``POST /flush_cache``
``POST /update_weights_from_disk``  ``{"model_path": folder, "weight_version": ..}``
``POST /load_lora_adapter``     ``{"lora_name": .., "lora_path": folder}``: a peft LoRA adapter,
                                merged into the weights (one at a time: load replaces the last)
``POST /unload_lora_adapter``   ``{"lora_name": ..}``: the base weights again
==============================  ==========================================================

LoRA: unlike SGLang, which keeps the base and applies adapters per request, this server merges
its one adapter into the weights. While one is loaded, ``/generate`` requests must name it
(``"lora_path": <lora_name>``, as SGLang's do) and requests without it are refused (they would
otherwise get the adapted model where SGLang gives the base).

Bad requests get HTTP 400 with ``{"error": {"message": ...}}``.

It also speaks the OpenAI API (:mod:`rl2gem.serving.openai_routes`: ``/v1/models``,
``/v1/chat/completions`` with tools and streaming, ``/v1/completions``), so any OpenAI
client can use it. ``--upstream URL`` serves that API (and ``/health``) in front of another
server speaking SGLang's native API instead of a local engine: an SGLang server, our own, or an
``sglang-router`` balancing over several; ``--model`` then only gives the tokenizer and chat
template.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from aiohttp import web

from rl2gem.aio import read_json_object
from rl2gem.procs import ServiceProcess
from rl2gem.rollout.engines.base import SamplingParams
from rl2gem.serving.openai_routes import add_openai_routes
from rl2gem.training.lora import load_adapter, merge_adapter

__all__ = ["NativeRoutes", "READY_PREFIX", "launch", "make_app"]

READY_PREFIX = "RL2GEM_SERVE_READY"


def _bad(message: str, status: int = 400):
    return web.json_response({"error": {"message": message}}, status=status)


def _output_json(out, tokenizer, return_logprob: bool) -> dict[str, Any]:
    meta = {
        "id": out.meta.get("id"),
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": str(out.weight_version),
        "e2e_latency": out.meta.get("e2e_latency"),
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
        if out.input_logprobs is not None:
            meta["input_token_logprobs"] = [[lp, None, None] for lp in out.input_logprobs]
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True) if tokenizer is not None else ""
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}


def make_app(
    engine,
    *,
    model_path: str = "",
    tokenizer=None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    native: bool = True,
):
    """The aiohttp application serving ``engine``.

    Args:
        engine: an :class:`EmbeddedEngine`; with ``native=False`` any
            :class:`~rl2gem.rollout.engines.base.Engine` (an ``HTTPEngine`` to an upstream server).
        model_path: reported by ``/get_model_info``.
        tokenizer: the model's tokenizer; without one only the native API is served.
        served_model_name: the model id of the OpenAI API (default: ``model_path``).
        chat_template: overrides the tokenizer's chat template in the OpenAI API.
        native: serve SGLang's native API (else only ``/health`` and the OpenAI API).
    """
    routes = web.RouteTableDef()
    api = NativeRoutes(engine, model_path=model_path, tokenizer=tokenizer)
    routes.get("/health")(api.health)
    routes.get("/health_generate")(api.health)
    if tokenizer is not None:
        add_openai_routes(
            routes, engine, tokenizer, model_name=served_model_name or model_path, chat_template=chat_template
        )
    if not native:
        return _application(routes, engine)
    for method, path, handler in (
        ("GET", "/get_load", api.get_load),
        ("GET", "/get_model_info", api.model_info),
        ("GET", "/get_server_info", api.server_info),
        ("GET", "/get_weight_version", api.weight_version),
        ("POST", "/generate", api.generate),
        ("POST", "/pause_generation", api.pause),
        ("POST", "/continue_generation", api.resume),
        ("POST", "/abort_request", api.abort),
        ("POST", "/flush_cache", api.flush),
        ("GET", "/flush_cache", api.flush),
        ("POST", "/update_weights_from_disk", api.update_weights_from_disk),
        ("POST", "/load_lora_adapter", api.load_lora_adapter),
        ("POST", "/unload_lora_adapter", api.unload_lora_adapter),
    ):
        routes.route(method, path)(handler)
    return _application(routes, engine)


def _json(request):
    return read_json_object(request, allow_empty=True)


def _failure(error: BaseException, status: int = 400):
    return web.json_response({"success": False, "message": f"{type(error).__name__}: {error}"}, status=status)


class NativeRoutes:
    """SGLang's native HTTP API over an engine: one method per route (aiohttp handlers).

    Holds which LoRA adapter is merged into the served weights and the base weights it replaced,
    so that ``/unload_lora_adapter`` can put them back.
    """

    def __init__(self, engine, *, model_path: str = "", tokenizer=None):
        self.engine, self.model_path, self.tokenizer = engine, model_path, tokenizer
        self.lora_name: str | None = None
        self.lora_base: dict[str, Any] | None = None  # base weights the merged adapter replaced

    async def health(self, _request):
        """``GET /health``, ``/health_generate``: 200 when the engine is up, else 503."""
        return web.Response(status=200 if await self.engine.health() else 503)

    async def get_load(self, _request):
        return web.json_response([{"dp_rank": 0, **self.engine.load()}])

    async def model_info(self, _request):
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": str(self.engine.weight_version),
                "preferred_sampling_params": None,
            }
        )

    async def server_info(self, _request):
        engine = self.engine
        return web.json_response(
            {
                "model_path": self.model_path,
                "engine": "rl2gem-embedded",
                "context_length": engine.context_length,
                "max_running_requests": engine.max_batch_size,
                "max_total_num_tokens": engine.max_cached_tokens,
                "weight_version": str(engine.weight_version),
                "paused": engine.paused,
                "internal_states": [dict(engine.stats)],
            }
        )

    async def weight_version(self, _request):
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """The request's prompts as token ids, and whether it was a batch. Raises ValueError."""
        ids = body.get("input_ids")
        if ids is None and "text" in body:
            if self.tokenizer is None:
                raise ValueError("this server needs input_ids")
            text = body["text"]
            ids = [self.tokenizer.encode(t) for t in text] if isinstance(text, list) else self.tokenizer.encode(text)
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids (or of such lists)")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for prompt in prompts:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("input_ids must contain integers")
        return prompts, batch

    async def generate(self, request):
        """``POST /generate``: token ids (or text) in, token ids and log-probs out."""
        try:
            body = await _json(request)
            prompts, batch = self._prompts(body)
            sp = body.get("sampling_params") or {}
            sps = sp if isinstance(sp, list) else [sp] * len(prompts)
            if len(sps) != len(prompts):
                raise ValueError("sampling_params list must match the batch size")
            params = [SamplingParams.from_dict(p) for p in sps]
            lora_name = body.get("lora_path")
            if lora_name != self.lora_name:
                raise ValueError(
                    f"lora_path {lora_name!r} is not the loaded adapter"
                    if lora_name is not None
                    else f"adapter {self.lora_name!r} is merged into this server's weights: requests must name it (lora_path)"
                )
            rid = body.get("rid")
            rids = (rid if isinstance(rid, list) else [None] * len(prompts)) if batch else [rid]
            return_logprob = bool(body.get("return_logprob", False))
            start = int(body.get("logprob_start_len", -1)) if return_logprob else -1
            outs = await asyncio.gather(
                *(
                    self.engine.generate(p, s, return_logprob=return_logprob, logprob_start_len=start, rid=r)
                    for p, s, r in zip(prompts, params, rids, strict=True)
                )
            )
        except (ValueError, TypeError) as e:
            return _bad(str(e))
        res = [_output_json(o, self.tokenizer, return_logprob) for o in outs]
        return web.json_response(res if batch else res[0])

    async def pause(self, request):
        try:
            body = await _json(request)
            await self.engine.pause(body.get("mode", "abort"))
        except ValueError as e:
            return _bad(str(e))
        return web.json_response({"status": "ok", "message": "generation paused"})

    async def resume(self, _request):
        await self.engine.resume()
        return web.json_response({"status": "ok", "message": "generation continued"})

    async def abort(self, request):
        try:
            body = await _json(request)
        except ValueError as e:
            return _bad(str(e))
        rid = None if body.get("abort_all") else body.get("rid")
        if rid is None and not body.get("abort_all"):
            return _bad("give rid or abort_all=true")
        await self.engine.abort(rid)
        return web.json_response({"status": "ok"})

    async def flush(self, _request):
        await self.engine.flush_cache()
        return web.Response(text="Cache flushed.")

    async def _set_weights(self, weights, version):
        return await self.engine.update_weights(weights, version=int(version) if version is not None else None)

    async def update_weights_from_disk(self, request):
        try:
            body = await _json(request)
            path = body.get("model_path")
            if not path:
                raise ValueError("model_path is required")
            version = await self._set_weights(path, body.get("weight_version"))
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            return _failure(e)
        self.lora_name, self.lora_base = None, None  # new base weights: no adapter is merged in them
        return web.json_response({"success": True, "message": "weights updated", "weight_version": str(version)})

    async def load_lora_adapter(self, request):
        """Merge a PEFT adapter into the served weights (the base weights it changes are kept)."""

        try:
            body = await _json(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path:
                raise ValueError("lora_name and lora_path are required")
            config, tensors = load_adapter(path)
            base = self.lora_base or {}
            current = {k: base.get(k, v) for k, v in self.engine.model.state_dict().items()}  # not a merged adapter's
            merged = merge_adapter(current, tensors, config)
            if self.lora_base is not None:  # weights the last adapter changed and this one does not: back to base
                merged = {**{k: v for k, v in self.lora_base.items() if k not in merged}, **merged}
            replaced = {k: current[k].detach().clone() for k in merged}
            version = await self._set_weights(merged, body.get("weight_version"))
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            return _failure(e)
        self.lora_name, self.lora_base = name, replaced
        return web.json_response(
            {"success": True, "message": f"adapter {name} merged", "loaded_adapters": {name: str(path)},
             "weight_version": str(version)}
        )  # fmt: skip

    async def unload_lora_adapter(self, request):
        try:
            body = await _json(request)
            if body.get("lora_name") != self.lora_name or self.lora_name is None:
                raise ValueError(f"adapter {body.get('lora_name')!r} is not loaded")
            version = await self._set_weights(self.lora_base, body.get("weight_version"))
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        self.lora_name, self.lora_base = None, None
        return web.json_response({"success": True, "message": "adapter unloaded", "weight_version": str(version)})


@web.middleware
async def _error_bodies(request, handler):
    """aiohttp's own 4xx answers (an unknown route, a wrong method, a body over the size limit) as
    JSON bodies like every other refusal: OpenAI's ``{"error": {...}}`` under ``/v1``, SGLang's
    ``{"success": false, "message": ...}`` elsewhere."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400 or error.status >= 500:
            raise
        message = f"{request.method} {request.path}: {error.reason}"
        if request.path.startswith("/v1/"):
            kind = "not_found_error" if error.status == 404 else "invalid_request_error"
            body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        else:
            body = {"success": False, "message": message}
        allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None  # 405 names the methods
        return web.json_response(body, status=error.status, headers=allow)


def _application(routes, engine):
    """An aiohttp application of ``routes`` that closes ``engine`` on shutdown."""
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_error_bodies])
    app.add_routes(routes)

    async def _close(_app):
        await engine.close()

    app.on_cleanup.append(_close)
    return app


def launch(
    model: str,
    *,
    port: int = 0,
    threads: int = 0,
    max_batch_size: int = 64,
    seed: int = 0,
    timeout: float = 300.0,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    upstream: str | None = None,
):
    """Start ``python -m rl2gem.serve`` as a child process and wait until it listens
    (the keyword arguments are its options, see :func:`main`).

    Returns:
        a :class:`rl2gem.procs.ServiceProcess` (``.url``, ``.stop()``, ``.kill()``);
        the server exits when that object's stdin pipe closes.

    Raises:
        RuntimeError: the server did not start (the message has its output).
    """
    cmd = [
        sys.executable,
        "-m",
        "rl2gem.serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-batch-size",
        str(max_batch_size),
        "--seed",
        str(seed),
        "--exit-on-stdin-eof",
    ]
    for flag, value in (
        ("--served-model-name", served_model_name),
        ("--chat-template", chat_template),
        ("--upstream", upstream),
    ):
        if value:
            cmd += [flag, str(value)]
    return ServiceProcess(cmd, ready_prefix=READY_PREFIX, timeout=timeout)
