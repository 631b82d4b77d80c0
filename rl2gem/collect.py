"""Collect supervised fine-tuning conversations by playing an env.

    python -m rl2gem.collect env=rl2/SearchQA-v0 policy=solver n=500 output=data/search.jsonl
    python -m rl2gem.collect env=rl2/GSM8K-v0 policy=model model=smollm2-135m-instruct n=200 min_reward=1.0 output=gsm8k.jsonl
    python -m rl2gem.collect env=rl2/ReasoningGym-v0 model=smollm2-135m-instruct n=500 pairs=true output=pairs.jsonl

Episodes are played by :func:`rl2gem.evaluation.evaluate` (same arguments, see
:data:`rl2gem.evaluation.DEFAULTS`; here ``split`` defaults to ``train``):
``policy=solver`` or ``random`` plays the env's scripted policy, ``policy=model``
plays ``model=`` through the rollout machinery, sampling at ``temperature=1.0``
unless given. With ``min_reward`` only episodes whose reward reaches it are kept
(rejection sampling when a model plays). Each kept episode becomes one JSON line of
``output`` (the file is rewritten, and written as episodes end, in episode order)::

    {"messages": [...], "reward": 1.0, "env": "rl2/SearchQA-v0", "seed": 0, "index": 0, "policy": "solver"}

(``"model": name`` is added when a model played: ``model=``, or the ``server=`` URL, which plays
without ``model=`` too). ``openai_base_url=`` is refused: it renders the env's tools with the API's
template, which the rows could not carry. The file is opened at the first finished task, so a run
refused before it leaves an existing ``output`` as it was. An episode that failed rather than
ended (a served env whose server went away: an empty observation and ``info["error"]``) is
counted on stderr, not written.

With ``pairs=true`` (a model policy) each task is played ``responses_per_prompt`` times (default
4) and each task whose episodes got different rewards yields one preference pair, RL2's RM / DPO
format (:func:`rl2gem.data.load_preferences`)::

    {"messages": [prompt...], "chosen": "...", "rejected": "...", "chosen_reward": 1.0,
     "rejected_reward": 0.0, "env": ..., "seed": ..., "index": ..., "policy": "model", "model": ...}

``chosen`` is the first episode with the group's highest reward, ``rejected`` the first with its
lowest (with ``min_reward``: chosen must reach it and rejected must not); each is the assistant's
reply as a string for a one-turn episode, else the messages from the first assistant turn on.

The messages are the ones a
:class:`~rl2gem.rollout.Rollout` renders: the optional system prompt, the first
observation, then each action and the env's reply to it (tool results one
``role="tool"`` message each), ending with the last action. The file is RL2's
``messages`` format: :func:`rl2gem.data.load_conversations` reads it and
:meth:`rl2gem.rollout.tito.ChatRenderer.conversation` tokenises each row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rl2gem.config import command_line_config, config_error_exit_code
from rl2gem.evaluation import DEFAULTS as EVALUATE_DEFAULTS
from rl2gem.evaluation import EpisodeRecord, check_arguments, default_output, evaluate
from rl2gem.procs import run_main

__all__ = ["DEFAULTS", "POLICIES", "collect", "episode_row", "pair_rows", "main", "parse_args"]

#: The ``policy`` values.
POLICIES = ("solver", "random", "model")

#: :data:`rl2gem.evaluation.DEFAULTS` with collection's own keys and defaults.
DEFAULTS: dict[str, Any] = {
    **EVALUATE_DEFAULTS,
    "policy": None,  # solver, random or model; None: model when model= is given, else solver
    "split": "train",
    "temperature": None,  # policy=model: 1.0 (sampling) unless given
    "min_reward": None,
    "pairs": False,  # preference pairs from groups of responses_per_prompt episodes per task
    "responses_per_prompt": None,  # None: 4 with pairs=true, else 1
}

#: Episodes per task of ``pairs=true`` when ``responses_per_prompt`` is not given.
PAIR_GROUP = 4

#: Sampling temperature of ``policy=model`` when none is given.
MODEL_TEMPERATURE = 1.0


def _resolve(cfg: DictConfig) -> DictConfig:
    """``cfg`` checked, with ``policy`` and ``temperature`` filled in.

    Raises:
        SystemExit: an unknown policy, ``policy=model`` without ``model=``, a scripted policy
            with ``model=``, ``tools_in_template=true`` (the rows would lack the tool schemas).
    """
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    served = cfg.server or cfg.openai_base_url  # a model plays there
    if cfg.policy is None:
        cfg.policy = "model" if cfg.model or served else "solver"
    if cfg.policy not in POLICIES:
        raise SystemExit(f"unknown policy {cfg.policy!r}; use one of {', '.join(POLICIES)}")
    if cfg.policy == "model" and not (cfg.model or served):
        raise SystemExit("policy=model needs model=... (e.g. model=smollm2-135m-instruct), server= or openai_base_url=")
    if cfg.policy != "model" and (cfg.model or served):
        given = "model" if cfg.model else "server" if cfg.server else "openai_base_url"
        raise SystemExit(f"policy={cfg.policy} does not use {given}={cfg[given]}; use policy=model or drop {given}=")
    if cfg.tools_in_template or cfg.openai_base_url:
        raise SystemExit(
            ("openai_base_url= (tools go to the API's template)" if cfg.openai_base_url else "tools_in_template=true")
            + " is not supported by collect: the rows would not carry the tool schemas the prompts were "
            "rendered with; use model= or server=, which leave the tools in the env's text"
        )
    if cfg.temperature is None:
        cfg.temperature = MODEL_TEMPERATURE if cfg.policy == "model" else 0.0
    if cfg.min_reward is not None:
        cfg.min_reward = float(cfg.min_reward)
    if cfg.responses_per_prompt is None:
        cfg.responses_per_prompt = PAIR_GROUP if cfg.pairs else 1
    if cfg.pairs and cfg.policy != "model":
        raise SystemExit("pairs=true samples several episodes per task: it needs policy=model and model=...")
    if cfg.pairs and int(cfg.responses_per_prompt) < 2:
        raise SystemExit(f"pairs=true needs responses_per_prompt >= 2, got {cfg.responses_per_prompt}")
    if int(cfg.n) < 1:
        raise SystemExit(f"n must be >= 1, got {cfg.n}")
    return cfg


def episode_row(record: EpisodeRecord, cfg: DictConfig) -> dict[str, Any]:
    """The JSON line of one episode (see the module doc)."""
    row = {
        "messages": record.messages,
        "reward": float(record.reward),
        "env": cfg.env,
        "seed": int(record.seed),
        "index": record.index,
        "policy": cfg.policy,
    }
    if cfg.policy == "model":
        row["model"] = cfg.model or cfg.server
    return row


def _continuation(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | list[dict[str, Any]]]:
    """An episode's messages as (prompt, continuation): the messages before the first assistant
    turn, and the rest (the reply's text when it is a single assistant message)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    rest = messages[first:]
    return messages[:first], rest[0]["content"] if len(rest) == 1 else rest


def pair_rows(records: list[EpisodeRecord], cfg: DictConfig) -> list[dict[str, Any]]:
    """The preference pairs of groups of ``cfg.responses_per_prompt`` consecutive records (one
    task each; see the module doc)."""
    size, rows = int(cfg.responses_per_prompt), []
    for start in range(0, len(records), size):
        group = records[start : start + size]
        best = max(group, key=lambda r: r.reward)
        worst = min(group, key=lambda r: r.reward)
        if best.reward <= worst.reward:
            continue
        if cfg.min_reward is not None and not (best.reward >= cfg.min_reward > worst.reward):
            continue
        prompt, chosen = _continuation(best.messages)
        _, rejected = _continuation(worst.messages)
        row = {
            "messages": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "chosen_reward": float(best.reward),
            "rejected_reward": float(worst.reward),
        }
        rows.append({**row, **{k: v for k, v in episode_row(best, cfg).items() if k not in ("messages", "reward")}})
    return rows


def failed(record: EpisodeRecord) -> bool:
    """Whether an episode ended on a failure rather than by the env's rules (a served env whose
    server went away: an empty observation and ``info["error"]``): not a demonstration."""
    return "error" in record.final_info or record.final_info.get("truncated_reason") == "remote_error"


class _RowWriter:
    """Writes rows to ``output`` as episodes end, in episode order: a task's rows as soon as it and
    every task before it are done, flushed, so a crash keeps every row of the tasks completed
    before it. The file is opened (rewritten) at the first task done: a run refused before any
    episode leaves an existing file as it was. Failed episodes (:func:`failed`) are counted, not
    written."""

    def __init__(self, output: Path, cfg: DictConfig):
        self.output, self.cfg, self.sink = output, cfg, None
        self.group = int(cfg.responses_per_prompt) if cfg.pairs else 1
        self.pending: dict[int, EpisodeRecord] = {}
        self.next = 0  # the first episode not yet written
        self.rows: list[dict[str, Any]] = []
        self.failed = 0

    def __call__(self, record: EpisodeRecord) -> None:
        self.pending[record.episode] = record
        while all(self.next + k in self.pending for k in range(self.group)):
            records = [self.pending.pop(self.next + k) for k in range(self.group)]
            self.next += self.group
            self.failed += sum(map(failed, records))
            records = [r for r in records if not failed(r)]
            if self.cfg.pairs:
                rows = pair_rows(records, self.cfg) if len(records) > 1 else []
            else:
                minimum = self.cfg.min_reward
                rows = [episode_row(r, self.cfg) for r in records if minimum is None or r.reward >= minimum]
            self.write(rows)

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.sink is None:
            self.sink = open(self.output, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.sink.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        self.sink.flush()
        self.rows += rows

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def collect(cfg: DictConfig) -> tuple[int, list[dict[str, Any]]]:
    """Play ``cfg.n`` episodes and write the kept ones to ``cfg.output`` (rewritten), each task's
    rows as soon as it and the tasks before it are done (a crash keeps what was finished).

    Args:
        cfg: :data:`DEFAULTS` merged with the arguments (see :func:`parse_args`).

    Returns:
        ``(episodes played, rows written)``.

    Raises:
        SystemExit: a bad argument (see :func:`_resolve`) or an env without a scripted solver.
    """
    cfg = _resolve(cfg)
    play = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    play.output = None  # evaluate's own records are not written; the rows below are
    if cfg.policy != "model":
        play.model = None
    output = Path(cfg.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = _RowWriter(output, cfg)
    try:
        records = evaluate(play, on_record=writer)
        writer.write([])  # a run that kept no row still rewrites the file
    finally:
        writer.close()
    if writer.failed:
        print(f"collect: {writer.failed} episodes failed (e.g. a served env's server went away); not written",
              file=sys.stderr)  # fmt: skip
    return len(records), writer.rows


def parse_args(argv: list[str]) -> DictConfig:
    """Merge ``key=value`` arguments over :data:`DEFAULTS` (``rl2gem.config.load_config``).

    Raises:
        SystemExit: 2 after ``config error: ...`` on stderr (a malformed argument, an unknown key
            with the closest valid one, an env that does not build with ``env_kwargs``); 0 after
            the help (``--help``).
    """
    cfg = command_line_config(DEFAULTS, check_arguments, argv)
    if cfg is None:
        raise SystemExit(config_error_exit_code())
    if cfg.output is None:
        cfg.output = default_output("collect", cfg.env, cfg.model or cfg.policy or "solver")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    played, rows = collect(cfg)
    rule = f" with reward >= {float(cfg.min_reward)}" if cfg.min_reward is not None else ""
    kept = f"{len(rows)} preference pairs" if cfg.pairs else f"kept {len(rows)}{rule}"
    print(f"{cfg.env}  split={cfg.split}  seed={cfg.seed}: played {played} episodes, {kept} -> {cfg.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
