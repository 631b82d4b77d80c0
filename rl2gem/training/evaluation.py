"""Evaluation of the policy being trained on an env's test split, spread over ranks.

The episodes are played by the same code as ``python -m rl2gem.evaluate`` (:func:`rl2gem.evaluation.task_resets`,
:func:`rl2gem.evaluation.play_model`), greedy unless the config says otherwise, so a trainer's
``eval/*`` numbers equal that CLI's on the exported checkpoint with the same settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

import rl2gem
from rl2gem.evaluation import episode_record, play_model, record_sums, task_resets

__all__ = ["evaluate_env"]


def evaluate_env(
    engine,
    tokenizer,
    env_id: str,
    env_kwargs: Mapping[str, Any],
    n: int,
    rollout_config,
    *,
    loop: asyncio.AbstractEventLoop,
    chat_template: str | None = None,
    seed: int = 0,
    split: str = "test",
) -> dict[str, float]:
    """Play the first ``n`` tasks of ``env_id``'s ``split`` (rank ``r`` plays every ``world``-th one)
    with ``engine`` and return the means over all ranks' episodes as ``eval/<name>`` (reward,
    success, turns, invalid_actions, response_tokens, and em / f1 / searches where an env reports
    them) plus ``eval/episodes``. A collective: call on every rank. An engine paused by partial
    rollouts is resumed for the evaluation and paused again after it (the paused groups stay
    waiting for the next collect).

    Args:
        rollout_config: :class:`rl2gem.rollout.RolloutConfig` (``responses_per_prompt`` 1).
        loop: the event loop the engine runs on.
    """
    kwargs = rl2gem.standard_kwargs(
        env_id, dict(env_kwargs), split=split, tools_in_template=rollout_config.tools_in_template
    )
    resets = task_resets(env_id, kwargs, n, seed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, len(resets), world))
    paused = engine.paused  # partial rollouts leave it paused between steps, their groups waiting
    if paused:
        loop.run_until_complete(engine.resume())
    try:
        episodes = loop.run_until_complete(
            play_model(
                engine,
                tokenizer,
                lambda: rl2gem.make(env_id, **kwargs),
                [resets[i] for i in mine],
                rollout_config,
                chat_template,
            )
        )
    finally:
        if paused:
            loop.run_until_complete(engine.pause("abort"))
    sums = record_sums([episode_record(i, ep, resets[i][0]) for i, ep in zip(mine, episodes, strict=True)])
    if dist.is_initialized():  # a rank whose episodes lack a reward component still reduces its slot
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(sums))
        sums = {name: sums.get(name, 0.0) for name in sorted(set().union(*every))}
    names = sorted(sums)
    totals = torch.tensor([sums[k] for k in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    totals = dict(zip(names, totals.tolist(), strict=True))
    count = max(totals["episodes"], 1.0)
    out = {f"eval/{k}": v / count for k, v in totals.items() if k != "episodes" and not k.startswith("reported/")}
    for k in [k for k in out if totals.get(f"reported/{k[5:]}") == 0.0]:  # a number the env never reports
        del out[k]
    out["eval/episodes"] = totals["episodes"]
    return out
