"""Command line: run a model (or a scripted policy) over an env and report accuracy.

    python -m rl2gem.evaluate env=rl2/GSM8K-v0 model=smollm2-135m-instruct n=50
    python -m rl2gem.evaluate env=rl2/Wordle-v0 policy=solver n=100

Arguments are ``key=value`` pairs (OmegaConf dot-list) over :data:`rl2gem.evaluation.DEFAULTS`;
how episodes are chosen and played (local model, ``server=``, ``openai_base_url=``, tools) is
:mod:`rl2gem.evaluation`'s. Each finished episode is written to ``output`` as it ends (JSON lines,
the file rewritten; default ``runs/evaluate/<env>-<who>-<time>-<pid>.jsonl``); a summary table is
printed at the end.
"""

from __future__ import annotations

import sys
import time

from rl2gem.config import command_line_config, config_error_exit_code
from rl2gem.evaluation import DEFAULTS, check_arguments, default_output, evaluate, summarize
from rl2gem.procs import run_main
from rl2gem.remote import RemoteEnvError
from rl2gem.rollout.engines.base import EngineError

__all__ = ["parse_args", "main"]


def parse_args(argv: list[str]):
    """Merge ``key=value`` arguments over :data:`DEFAULTS`, checked before anything loads (an
    unknown key names the closest valid one; the env must build with ``env_kwargs``).

    Raises:
        SystemExit: 2 after ``config error: ...`` on stderr; 0 after the help (``--help``).
    """
    cfg = command_line_config(DEFAULTS, check_arguments, argv)
    if cfg is None:
        raise SystemExit(config_error_exit_code())
    if cfg.output is None:
        cfg.output = default_output(
            "evaluate", cfg.env, cfg.openai_model or cfg.model or ("server" if cfg.server else cfg.policy)
        )
    return cfg


def _server_errors() -> tuple[type[Exception], ...]:
    """The errors of a server that went away: the engine's, an env server's and the openai
    client's (an optional package: the GPU image has none)."""
    try:
        from openai import APIConnectionError, APIStatusError
    except ImportError:
        return (RemoteEnvError, EngineError)
    return (APIConnectionError, APIStatusError, RemoteEnvError, EngineError)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    finished: list = []  # this run's records, as they are written
    try:
        records = evaluate(cfg, finished.append)
    except _server_errors() as error:  # a server went away
        where = f"in {cfg.output}" if finished else "written"
        raise SystemExit(
            f"evaluate: {type(error).__name__}: {error} ({len(finished)} finished episodes {where})"
        ) from None
    if cfg.openai_base_url:
        who = f"openai_model={cfg.openai_model} at {cfg.openai_base_url}"
    elif cfg.server:
        who = f"server={cfg.server}"
    else:
        who = f"model={cfg.model}" if cfg.model else f"policy={cfg.policy}"
    print(f"{cfg.env}  {who}  split={cfg.split}  seed={cfg.seed}  episodes -> {cfg.output}")
    print(summarize(records, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    run_main(main)
