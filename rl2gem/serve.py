"""``python -m rl2gem.serve``: the command line of the HTTP server (:mod:`rl2gem.serving`).

    python -m rl2gem.serve --model smollm2-135m-instruct --port 30000 [--chat-template chatml_tools]
    python -m rl2gem.serve --model smollm2-135m-instruct --upstream http://127.0.0.1:30001

The embedded engine (or, with ``--upstream``, another server speaking SGLang's native API) behind
SGLang's native API and the OpenAI API; the routes are :mod:`rl2gem.serving.server` and
:mod:`rl2gem.serving.openai_routes`. It prints ``RL2GEM_SERVE_READY <url>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import torch
from transformers import AutoConfig, AutoTokenizer

from rl2gem.models import DTYPES, causal_lm_problem, load_model, model_problem, resolve_device, resolve_model
from rl2gem.procs import run_main, serve_app
from rl2gem.rollout.engines.embedded import EmbeddedEngine
from rl2gem.rollout.engines.http import HTTPEngine, served_context_length
from rl2gem.rollout.tito import load_chat_template
from rl2gem.serving.server import READY_PREFIX, make_app

__all__ = ["main"]


async def _serve(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    template = load_chat_template(args.chat_template)
    name = args.served_model_name or args.model
    if args.upstream:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        engine = HTTPEngine(args.upstream)
        # the OpenAI API refuses prompts past the context: the upstream's, not a default
        engine.context_length = args.context_length or await asyncio.to_thread(served_context_length, args.upstream)
        if not engine.context_length:
            config = AutoConfig.from_pretrained(resolve_model(args.model))
            engine.context_length = getattr(config, "max_position_embeddings", None)
        app = make_app(engine, tokenizer=tokenizer, served_model_name=name, chat_template=template, native=False)
    else:
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
        engine = EmbeddedEngine(
            model,
            tokenizer,
            max_batch_size=args.max_batch_size,
            max_cached_tokens=args.max_cached_tokens,
            seed=args.seed,
        )
        app = make_app(
            engine,
            model_path=resolve_model(args.model),
            tokenizer=tokenizer,
            served_model_name=name,
            chat_template=template,
        )
    await serve_app(app, args.host, args.port, READY_PREFIX, args.exit_on_stdin_eof)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rl2gem.serve",
        description="HTTP server for the embedded engine: SGLang's native API and the OpenAI API.",
    )
    p.add_argument("--model", required=True, help="built-in name, folder or hub id (no download at run time)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-cached-tokens", type=int, default=1 << 17)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when a GPU is visible, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--served-model-name", default=None, help="model id of the OpenAI API (default: --model)")
    p.add_argument("--chat-template", default=None, help="built-in name, Jinja file or text (OpenAI API rendering)")
    p.add_argument("--upstream", default=None, help="serve the OpenAI API in front of this SGLang-API server/router")
    p.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="with --upstream: the model's context (default: the upstream's /get_server_info, else the model config)",
    )
    p.add_argument("--exit-on-stdin-eof", action="store_true", help="stop when stdin closes (used by launchers)")
    args = p.parse_args(argv)
    try:
        resolve_device(args.device)
    except ValueError as e:
        p.error(f"--device: {e}")  # exits with 2 before anything loads
    if problem := model_problem(args.model) or causal_lm_problem(args.model):
        p.error(f"--model: {problem}")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    run_main(main)
