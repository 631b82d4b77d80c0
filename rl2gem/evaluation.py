"""Evaluation: play a model (or a scripted policy) over an env, record each episode, sum them up.

The library behind ``python -m rl2gem.evaluate`` (:mod:`rl2gem.evaluate`, the command line) and
the trainers' periodic evaluation (:mod:`rl2gem.training.evaluation`). A config is a mapping of
:data:`DEFAULTS`' keys (``load_config(DEFAULTS, ["key=value", ...])``).
``model`` is a built-in name (``smollm2-135m-instruct``, see
:mod:`rl2gem.models`), a local folder or a hub id; without it ``policy``
(``solver`` or ``random``) plays. A model plays through the rollout machinery
of :mod:`rl2gem.rollout`: the embedded continuous-batching engine
(``batch_size`` sequences decoded together), token-in/token-out multi-turn
episodes on the model's chat template, greedy unless ``temperature > 0``. An episode's sequence
holds at most ``max_length`` tokens (default and upper bound: the model's context length, as
the engine or ``server``'s ``/get_server_info`` reports it; 4096 where neither does); an
episode that reaches it ends truncated, which the summary counts by reason.

Episodes: an env with a data set (``len(env)``) plays its first ``n`` items in
order (``reset(options={"index": i})``), so runs are comparable across
models; other envs play seeds ``seed, seed+1, ...``; with ``responses_per_prompt=k``
each task is played ``k`` times in a row (episodes ``i*k`` to ``i*k+k-1``). ``split`` (default
``test``) is passed to envs that take one. Each finished episode is appended
to ``output`` (JSON lines, flushed at once: a crash loses nothing written; an existing file is
rewritten by the run); a summary table is printed at the end.

Tool envs offer their tools as text in the observation by default. With
``tools_in_template=true`` the model's own chat template renders them instead
(the env's ``info["tools"]`` passed as ``tools=``; the env is made with
``tool_prompt=None``); ``chat_template`` (a Jinja file or text) overrides the
tokenizer's, for models whose template has no tool support.

Served models: ``server=URL`` plays through
:class:`~rl2gem.rollout.engines.http.HTTPEngine` (SGLang's native API, token-in/token-out:
an SGLang server, ``python -m rl2gem.serve`` or an ``sglang-router``), exactly as a local
model plays, so greedy numbers equal those of the same weights run locally; the tokenizer is
``model=``'s, else the server's ``/get_model_info`` ``tokenizer_path``.
``openai_base_url=URL openai_model=NAME`` plays through the OpenAI Chat Completions API with
the official ``openai`` client: messages in, text out (the chat history is re-rendered by the
server each turn); a tool env's tools go as ``tools=`` and the reply's ``tool_calls`` become
the env's ``<tool_call>`` action; the API key is read from ``OPENAI_API_KEY`` (``EMPTY`` when
unset, which local servers accept); failed requests are retried with exponential backoff
(``openai_max_retries``); at most ``openai_concurrency`` requests are in flight.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rl2gem.aio import run_coroutine
from rl2gem.config import ConfigError
from rl2gem.env_protocol import dataset_size
from rl2gem.models import causal_lm_problem, load_model, model_problem, resolve_device, resolve_dtype, resolve_model
from rl2gem.registry import env_config_problem, env_id_problem
from rl2gem.rollout.engines.http import served_context_length
from rl2gem.rollout.rollout import ENV_ERROR_POLICIES, EnvError, reply_messages, warn_env_error

__all__ = [
    "paired_comparison",
    "pass_at_k",
    "solved",
    "DEFAULTS",
    "EpisodeRecord",
    "evaluate",
    "summarize",
    "task_resets",
    "default_output",
    "episode_max_length",
    "play_model",
    "episode_record",
    "record_sums",
]

DEFAULTS: dict[str, Any] = {
    "env": "rl2/GuessTheNumber-v0",
    "model": None,
    "policy": "solver",
    "n": 100,
    "responses_per_prompt": 1,  # episodes per task (a group: pass@k, preference pairs)
    "split": "test",
    "seed": 0,
    "device": "auto",  # a local model's device: auto is CUDA when a GPU is visible, else the CPU
    "dtype": "auto",  # a local model's dtype: auto is bfloat16 on CUDA, float32 on the CPU
    "batch_size": 16,
    "max_new_tokens": 512,
    "max_length": None,  # tokens per episode's sequence (prompt, actions, replies); null: the model's context length
    "temperature": 0.0,
    "top_p": 1.0,
    "system_prompt": None,
    "output": None,
    "progress": True,
    "env_kwargs": {},
    "tools_in_template": False,
    "chat_template": None,
    "context": {"max_tokens": None, "policy": "truncate", "summary_max_new_tokens": 128},  # rl2gem.rollout.context
    "server": None,  # URL of a server speaking SGLang's native API (or a router in front of several)
    "openai_base_url": None,  # e.g. http://127.0.0.1:30000/v1: play through the OpenAI Chat Completions API
    "openai_model": None,  # the model name the API serves (required with openai_base_url)
    "openai_concurrency": 16,  # requests in flight
    "openai_max_retries": 5,  # per request, exponential backoff (the openai client's own retry logic)
    "openai_timeout": 300.0,  # seconds per request
    "env_errors": "drop",  # an env that raises: drop (the episode recorded truncated, info error) | raise
}


@dataclass
class EpisodeRecord:
    """One finished episode. ``messages`` are those of its last context segment; ``context_segments``
    counts the segments started after the first and ``summaries`` the summaries written
    (``context.max_tokens``, :mod:`rl2gem.rollout.context`; 0 without)."""

    episode: int
    seed: int
    index: int | None
    reward: float
    turns: int
    success: bool
    terminated: bool
    truncated: bool
    invalid_actions: int
    format_ok: bool | None
    generated_tokens: int
    messages: list[dict[str, str]] = field(default_factory=list)
    final_info: dict[str, Any] = field(default_factory=dict)
    context_segments: int = 0
    summaries: int = 0


def env_kwargs(cfg) -> dict[str, Any]:
    """``cfg.env_kwargs`` as plain Python values (OmegaConf lists and dicts converted: envs hash
    and compare them)."""
    value = cfg.env_kwargs
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else dict(value)


def check_arguments(cfg) -> None:
    """The checks of ``python -m rl2gem.evaluate`` / ``rl2gem.collect`` before anything loads:
    ``device`` and ``dtype`` name one, ``cfg.model`` (if given) names a causal LM folder or a
    built-in name, ``cfg.env`` is a registered id (``module:id`` imports
    ``module``) and the env builds with ``cfg.env_kwargs`` and ``cfg.split``.

    Raises:
        rl2gem.config.ConfigError: naming the key.
    """
    import rl2gem  # noqa: F401  (registers the envs)

    for key, resolve in (("device", resolve_device), ("dtype", lambda name: resolve_dtype(name, "cpu"))):
        try:
            resolve(cfg[key])
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if cfg.get("env_errors", "drop") not in ENV_ERROR_POLICIES:
        raise ConfigError(f"env_errors: expected one of {list(ENV_ERROR_POLICIES)}, got {cfg.env_errors!r}")

    if problem := env_id_problem(cfg.env):
        raise ConfigError(f"env: {problem}")
    if problem := env_config_problem(cfg.env, env_kwargs(cfg), split=cfg.split):
        raise ConfigError(f"env_kwargs: {problem}")
    if cfg.get("model") and (problem := model_problem(str(cfg.model)) or causal_lm_problem(str(cfg.model))):
        raise ConfigError(f"model: {problem}")


def _scripted(policy: str, env: gym.Env, rng: np.random.Generator) -> Callable[[], Callable[[str], str]]:
    base = env.unwrapped
    if policy == "solver":
        if not hasattr(base, "make_solver"):
            raise SystemExit(f"{base!r} has no scripted solver; use policy=random or model=...")
        return base.make_solver
    if policy == "random":
        if hasattr(base, "sample_random_action"):
            return lambda: lambda obs: base.sample_random_action(rng=rng)
        env.action_space.seed(int(rng.integers(2**31)))  # the run's seed decides the actions
        return lambda: lambda obs: env.action_space.sample()
    raise SystemExit(f"unknown policy {policy!r}; use solver or random (or model=...)")


def _make_env(cfg, tools_in_template: bool | None = None) -> gym.Env:
    from rl2gem.registry import standard_kwargs

    if tools_in_template is None:
        tools_in_template = bool(getattr(cfg, "tools_in_template", False))
    kwargs = standard_kwargs(cfg.env, env_kwargs(cfg), split=cfg.split, tools_in_template=tools_in_template)
    return gym.make(cfg.env, **kwargs)


def _scalar(value) -> bool:
    return isinstance(value, (str, int, float, bool, type(None)))


def _plain(info: dict) -> dict:
    """The JSON-plain part of an info: scalars and mappings of scalars (``reward_components``)."""
    return {
        k: v
        for k, v in info.items()
        if not k.startswith("_") and (_scalar(v) or (isinstance(v, dict) and all(map(_scalar, v.values()))))
    }


def task_resets(env_id: str, env_kwargs: dict[str, Any], n: int, seed: int = 0) -> list[tuple[int, dict | None]]:
    """The ``(seed, options)`` of the first ``n`` evaluation episodes: an env with a data set
    (``len(env)``) plays its items in order (``options={"index": i}``, at most ``len(env)``);
    others play seeds ``seed, seed + 1, ...``."""
    import rl2gem

    probe = rl2gem.make(env_id, **env_kwargs)
    try:
        size = dataset_size(probe)
    finally:
        probe.close()
    indexed = size is not None
    count = min(n, size) if indexed else n
    return [(seed + i, {"index": i} if indexed else None) for i in range(count)]


def episode_record(position: int, episode, reset_seed: int) -> EpisodeRecord:
    """The :class:`EpisodeRecord` of a rollout :class:`~rl2gem.rollout.tito.Episode`."""
    info = episode.info
    return EpisodeRecord(
        episode=position,
        seed=info.get("seed", reset_seed),
        index=info.get("index"),
        reward=episode.reward,
        turns=episode.turns,
        success=bool(info.get("success", episode.reward > 0)),
        terminated=episode.terminated,
        truncated=episode.truncated,
        invalid_actions=info.get("num_invalid_actions", 0),
        format_ok=info.get("format_ok"),
        generated_tokens=episode.num_action_tokens,
        messages=episode.messages,
        final_info=_plain(info),
        context_segments=episode.segments,
        summaries=episode.summaries,
    )


#: per-episode numbers summed by :func:`record_sums`: name -> how a record gives it
_SUMS: dict[str, Callable[[EpisodeRecord], float]] = {
    "reward": lambda r: r.reward,
    "success": lambda r: float(r.success),
    "turns": lambda r: r.turns,
    "invalid_actions": lambda r: r.invalid_actions,
    "response_tokens": lambda r: r.generated_tokens,
    "em": lambda r: float(r.final_info.get("em") or 0.0),
    "f1": lambda r: float(r.final_info.get("f1") or 0.0),
    "searches": lambda r: float(r.final_info.get("num_searches") or 0.0),
}


#: numbers that only some envs report: name -> key of the final info
_REPORTED = {"em": "em", "f1": "f1", "searches": "num_searches"}


def record_sums(records: list[EpisodeRecord]) -> dict[str, float]:
    """Sums of the per-episode numbers of ``records``, ``reported/<name>`` (how many episodes'
    envs report em, f1, searches), ``component/<name>`` (the env's ``info["reward_components"]``)
    and ``episodes`` (their count): add them over ranks, then divide by ``episodes`` for the means
    (:func:`rl2gem.training.evaluate_env`)."""
    sums = {name: float(sum(get(r) for r in records)) for name, get in _SUMS.items()}
    for r in records:
        for name, value in dict(r.final_info.get("reward_components") or {}).items():
            sums[f"component/{name}"] = sums.get(f"component/{name}", 0.0) + float(value)
    for name, key in _REPORTED.items():  # episodes whose env reports the number at all
        sums[f"reported/{name}"] = float(sum(isinstance(r.final_info.get(key), (int, float)) for r in records))
    sums["episodes"] = float(len(records))
    return sums


async def play_model(
    engine,
    tokenizer,
    env_factory: Callable[[], gym.Env],
    resets: list[tuple[int, dict | None]],
    config,
    chat_template: str | None = None,
    on_episode: Callable[[int, Any], None] | None = None,
) -> list:
    """Play one episode per reset with ``engine`` through a :class:`~rl2gem.rollout.Rollout`
    (token-in/token-out, prefix-merged), as both ``python -m rl2gem.evaluate`` and the trainers'
    evaluation do. Returns the episodes in the order of ``resets``."""
    from rl2gem.rollout import Rollout

    rollout = Rollout(engine, tokenizer, env_factory, config, chat_template=chat_template)
    try:
        return await rollout.play(resets, on_episode)
    finally:
        await rollout.close()


def solved(record: EpisodeRecord) -> bool:
    """Exact match where the env reports it, else success."""
    em = record.final_info.get("em")
    return bool(em) if isinstance(em, (int, float)) else bool(record.success)


def pass_at_k(records: list[EpisodeRecord]) -> dict[int, float]:
    """pass@k over the tasks of ``records`` (a task's episodes share ``(seed, index)``; played
    ``responses_per_prompt`` times each): the unbiased estimator of Chen et al. 2021 ("Evaluating
    large language models trained on code", eq. 1), ``1 - C(n - c, k) / C(n, k)`` for a task with
    ``n`` episodes of which ``c`` are :func:`solved`, averaged over tasks.

    Returns:
        ``{k: pass@k}`` for ``k`` = 1, 2, 4, ... up to the fewest episodes any task has, and that
        number itself; ``{}`` without records.
    """
    outcomes: dict[tuple, list[bool]] = {}
    for record in records:
        outcomes.setdefault((record.seed, record.index), []).append(solved(record))
    if not outcomes:
        return {}
    fewest = min(len(values) for values in outcomes.values())
    ks = sorted({2**power for power in range(fewest.bit_length()) if 2**power <= fewest} | {fewest})
    return {
        k: sum(1 - math.comb(len(v) - sum(v), k) / math.comb(len(v), k) for v in outcomes.values()) / len(outcomes)
        for k in ks
    }


def paired_comparison(before: list[EpisodeRecord], after: list[EpisodeRecord]) -> tuple[int, int, float]:
    """Two models on the same items (matched by ``(seed, index)``): the items ``after`` solves
    more often than ``before`` (:func:`solved`; with one response per item, those only ``after``
    solves), those it solves less often, and the exact two-sided sign test's p-value on those
    discordant items (binomial, p = 1/2; McNemar's exact test with one response per item). An
    item's several responses (``responses_per_prompt``) count as its solve rate, not as items.

    Raises:
        ValueError: the two lists do not cover the same items.
    """

    def solve_rates(records: list[EpisodeRecord]) -> dict[tuple, float]:
        outcomes: dict[tuple, list[bool]] = {}
        for record in records:
            outcomes.setdefault((record.seed, record.index), []).append(solved(record))
        return {key: sum(values) / len(values) for key, values in outcomes.items()}

    first, second = solve_rates(before), solve_rates(after)
    if first.keys() != second.keys():
        raise ValueError("the two evaluations are not on the same items")
    gained = sum(second[key] > first[key] for key in first)
    lost = sum(second[key] < first[key] for key in first)
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return gained, lost, min(1.0, 2 * tail)


def _evaluate_model(cfg, resets, emit) -> None:
    from rl2gem.rollout import EmbeddedEngine, HTTPEngine, RolloutConfig
    from rl2gem.rollout.tito import load_chat_template

    if cfg.server:
        model, tokenizer = None, _served_tokenizer(cfg)
    else:
        model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)

    async def run() -> None:
        if cfg.server:
            engine = HTTPEngine(cfg.server)
            context = served_context_length(cfg.server)
        else:
            engine = EmbeddedEngine(model, tokenizer, max_batch_size=cfg.batch_size, seed=cfg.seed)
            context = engine.context_length
        rcfg = RolloutConfig.from_mapping(
            cfg,
            responses_per_prompt=1,
            max_length=episode_max_length(cfg.get("max_length"), context),
            concurrency=cfg.batch_size,
            tools_in_template=bool(cfg.tools_in_template),
            progress=False,
        )
        try:
            await play_model(
                engine,
                tokenizer,
                lambda: _make_env(cfg),
                resets,
                rcfg,
                load_chat_template(cfg.chat_template),
                lambda i, ep: emit(episode_record(i, ep, resets[i][0])),
            )
        finally:
            await engine.close()

    run_coroutine(run())


def default_output(folder: str, env: str, who: str) -> str:
    """A results file no other run names: ``runs/<folder>/<env>-<who>-<time>-<pid>.jsonl``."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return f"runs/{folder}/{env.replace('/', '_')}-{who.replace('/', '_')}-{stamp}.jsonl"


def episode_max_length(requested: int | None, context_length: int | None) -> int:
    """Tokens an evaluation episode's sequence may hold: ``requested`` (None: all it can), at most
    ``context_length - 1`` (SGLang refuses a request whose prompt and ``max_new_tokens`` reach the
    context; None: unknown, then 4096 by default).

    Raises:
        SystemExit: ``requested`` is not a positive integer.
    """
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        raise SystemExit(f"max_length must be a positive integer or null, got {requested!r}")
    if context_length is None:
        return requested or 4096
    room = max(1, context_length - 1)
    return min(requested or room, room)


def _served_tokenizer(cfg):
    """The tokenizer for ``server=``: ``model=``'s, else the one ``/get_model_info`` names."""
    import json as _json
    import urllib.request

    from transformers import AutoTokenizer

    if cfg.model:
        return AutoTokenizer.from_pretrained(resolve_model(cfg.model))
    url = cfg.server.rstrip("/") + "/get_model_info"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            path = _json.loads(r.read().decode())["tokenizer_path"]
    except Exception as e:
        raise SystemExit(f"server={cfg.server}: could not read the tokenizer from {url} ({e}); pass model=") from None
    return AutoTokenizer.from_pretrained(path)


def _record(position: int, reset_info, total: float, term: bool, trunc: bool, info, messages, tokens: int):
    """The :class:`EpisodeRecord` of an episode played step by step (a scripted policy, an API);
    ``reset_info`` is the info ``reset`` returned, ``info`` the last step's."""
    return EpisodeRecord(
        episode=position,
        seed=reset_info["seed"],
        index=reset_info.get("index"),
        reward=total,
        turns=info["turn"],
        success=bool(info.get("success", total > 0)),
        terminated=term,
        truncated=trunc,
        invalid_actions=info.get("num_invalid_actions", 0),
        format_ok=info.get("format_ok"),
        generated_tokens=tokens,
        messages=messages,
        final_info=_plain(info),
    )


def _env_error_record(cfg, position: int, reset, error: Exception, where: str, played: tuple, seen: set):
    """The record of an episode whose env raised (``where``: the call, its turn) under
    ``env_errors=drop``, truncated with ``info["error"]`` as :meth:`rl2gem.rollout.Rollout.play`
    keeps one; ``reset``: its ``(seed, options)``; ``played``: ``(messages, tokens, reward so
    far)``. The error is warned once per distinct one.

    Raises:
        EnvError: the error, with ``env_errors=raise``.
    """
    wrapped = EnvError.raised(cfg.env, where, error)
    if cfg.get("env_errors", "drop") == "raise":
        raise wrapped
    warn_env_error(wrapped, seen)
    (seed, options), (messages, tokens, total) = reset, played
    turns = sum(m["role"] == "assistant" for m in messages)
    info = {"turn": turns, "error": str(wrapped), "truncated_reason": "env_error"}
    task = {"seed": seed, "index": (options or {}).get("index")}  # a data set's item, for paired comparisons
    return _record(position, task, total, False, True, info, messages, tokens)


def _evaluate_openai(cfg, resets, emit) -> None:
    """Play ``resets`` through an OpenAI-compatible Chat Completions API (see the module doc)."""
    import asyncio
    import os

    from openai import NOT_GIVEN, AsyncOpenAI, BadRequestError

    from rl2gem.rollout.engines.base import mix_seed
    from rl2gem.tools.base import hermes_tool_calls

    if not cfg.openai_model:
        raise SystemExit("openai_base_url needs openai_model=NAME (the model the API serves; see its /v1/models)")

    async def run() -> None:
        client = AsyncOpenAI(
            base_url=cfg.openai_base_url,
            api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY",
            max_retries=int(cfg.openai_max_retries),
            timeout=float(cfg.openai_timeout),
        )
        in_flight = asyncio.Semaphore(int(cfg.openai_concurrency))

        seen: set = set()

        async def episode(position: int, seed: int, options) -> None:
            env = _make_env(cfg, tools_in_template=True)
            shown, tokens, total, where = [], 0, 0.0, f"areset (seed {seed})"
            try:
                obs, info = await _env_call(env.areset(seed=seed, options=options), shown, None)
                reset_info = info
                system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
                api = system + [{"role": info.get("role", "user"), "content": obs}]  # what the API sees
                shown = [dict(m) for m in api]  # the rl2gem form, as a local evaluation records it
                tools = info.get("tools") or NOT_GIVEN
                total, tokens, done, turn = 0.0, 0, False, 0
                while not done:
                    # each episode and turn its own sampling seed: the k responses to a task share
                    # its reset seed, and one request seed would make them copies on a server that honours it
                    request_seed = mix_seed(int(cfg.seed), position, turn) % 2**31
                    turn += 1
                    async with in_flight:
                        reply = await client.chat.completions.create(
                            model=cfg.openai_model,
                            messages=api,
                            tools=tools,
                            max_tokens=int(cfg.max_new_tokens),
                            temperature=float(cfg.temperature),
                            top_p=float(cfg.top_p),
                            seed=request_seed,
                        )
                    message = reply.choices[0].message
                    tokens += reply.usage.completion_tokens if reply.usage else 0
                    calls = [c.model_dump() for c in message.tool_calls or []]
                    action = "\n".join(t for t in (message.content or "", hermes_tool_calls(calls)) if t)
                    where = f"astep (seed {seed}, turn {turn})"
                    obs, reward, term, trunc, info = await _env_call(env.astep(action), shown, action)
                    total += float(reward)
                    done = term or trunc
                    api.append(
                        {"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}
                    )
                    shown.append({"role": "assistant", "content": action})
                    if not done:
                        replies = reply_messages(obs, info)
                        shown += replies
                        for k, m in enumerate(replies):  # tool results answer the calls, in order
                            if m["role"] == "tool" and k < len(calls):
                                api.append({**m, "tool_call_id": calls[k]["id"]})
                            else:
                                api.append(
                                    {"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]}
                                )
                emit(_record(position, reset_info, total, term, trunc, info, shown, tokens))
            except _EnvCallFailed as failed:
                played = (shown, tokens, total)
                emit(_env_error_record(cfg, position, (seed, options), failed.__cause__, where, played, seen))
            finally:
                await env.aclose()

        try:
            await asyncio.gather(*(episode(i, seed, options) for i, (seed, options) in enumerate(resets)))
        except BadRequestError as e:  # a request the API refuses will not pass on the next episode either
            raise SystemExit(f"{cfg.openai_base_url} refused the request: {e.message}") from None
        finally:
            await client.close()

    run_coroutine(run())


class _EnvCallFailed(Exception):
    """An env call of an evaluation raised (``__cause__``): not the policy's or the API's error."""


def _env_step(call: Callable, *args, **kwargs):
    """``call(*args, **kwargs)`` (an env's reset or step); its error raised as :class:`_EnvCallFailed`."""
    try:
        return call(*args, **kwargs)
    except Exception as error:
        raise _EnvCallFailed from error


async def _env_call(awaitable, messages: list, action: str | None):
    """``await awaitable`` (an env's ``areset``, or its ``astep`` of ``action``); on an error
    ``action`` joins ``messages`` (the record shows it) and the error is raised as
    :class:`_EnvCallFailed`."""
    try:
        return await awaitable
    except Exception as error:
        if action is not None:
            messages.append({"role": "assistant", "content": action})
        raise _EnvCallFailed from error


def _evaluate_scripted(cfg, env, resets, emit) -> None:
    """Play ``resets`` with a scripted policy; the messages are those a Rollout builds
    (env replies by :func:`rl2gem.rollout.rollout.reply_messages`, none after the last action)."""
    rng = np.random.default_rng(cfg.seed)
    make_policy = _scripted(cfg.policy, env, rng)
    seen: set = set()
    try:
        for i, (seed, options) in enumerate(resets):
            messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            where, total = f"reset (seed {seed})", 0.0
            try:
                obs, info = _env_step(env.reset, seed=seed, options=options)
                reset_info = info
                messages.append({"role": info.get("role", "user"), "content": obs})
                policy, total, done, turn = make_policy(), 0.0, False, 0
                while not done:
                    action = policy(obs)
                    messages.append({"role": "assistant", "content": action})
                    turn += 1
                    where = f"step (seed {seed}, turn {turn})"
                    obs, r, term, trunc, info = _env_step(env.step, action)
                    total += r
                    done = term or trunc
                    if not done:
                        messages += reply_messages(obs, info)
                emit(_record(i, reset_info, total, term, trunc, info, messages, 0))
            except _EnvCallFailed as failed:
                played = (messages, 0, total)
                emit(_env_error_record(cfg, i, (seed, options), failed.__cause__, where, played, seen))
    finally:
        env.close()


def evaluate(cfg, on_record: Callable[[EpisodeRecord], None] | None = None) -> list[EpisodeRecord]:
    """Play ``cfg.n`` episodes (see the module doc); returns their records.

    Args:
        cfg: :data:`DEFAULTS` merged with the arguments.
        on_record: called with each record as its episode ends (in completion order, which with
            a model is not the episode order), after it is written to ``cfg.output``.
    """
    import rl2gem  # noqa: F401  (registers the envs)
    from rl2gem.registry import standard_kwargs

    if cfg.openai_base_url and cfg.server:
        raise SystemExit("give server= (SGLang's native API) or openai_base_url= (the OpenAI API), not both")
    episode_max_length(cfg.get("max_length"), None)  # a bad max_length fails before anything loads
    tools_in_template = bool(cfg.tools_in_template) or bool(cfg.openai_base_url)
    kwargs = standard_kwargs(cfg.env, env_kwargs(cfg), split=cfg.split, tools_in_template=tools_in_template)
    resets = task_resets(cfg.env, kwargs, cfg.n, cfg.seed)
    group = int(cfg.get("responses_per_prompt", 1))
    if group < 1:
        raise SystemExit(f"responses_per_prompt must be >= 1, got {group}")
    resets = [reset for reset in resets for _ in range(group)]  # a task's episodes are consecutive
    n = len(resets)
    out_path = Path(cfg.output) if cfg.output else None
    sink = None  # opened at the first record: a run refused before any episode leaves no empty file
    records: list[EpisodeRecord] = []
    bar = tqdm(total=n, desc=cfg.env, disable=not cfg.progress, file=sys.stderr)

    def emit(rec: EpisodeRecord) -> None:
        nonlocal sink
        records.append(rec)
        if out_path is not None:
            if sink is None:
                out_path.parent.mkdir(parents=True, exist_ok=True)
                sink = open(out_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in the finally below)
            sink.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
            sink.flush()
        if on_record is not None:
            on_record(rec)
        bar.update(1)

    try:
        if cfg.openai_base_url:
            _evaluate_openai(cfg, resets, emit)
        elif cfg.model or cfg.server:
            _evaluate_model(cfg, resets, emit)
        else:
            _evaluate_scripted(cfg, _make_env(cfg), resets, emit)
    finally:
        bar.close()
        if sink:
            sink.close()
    records.sort(key=lambda r: r.episode)
    return records


def _truncations(records: list[EpisodeRecord]) -> str:
    """The share of truncated episodes and their count per ``truncated_reason`` (``max_length``:
    cut at the sequence's token budget, before or during the episode)."""
    reasons = Counter(str(r.final_info.get("truncated_reason", "env")) for r in records if r.truncated)
    share = f"{sum(reasons.values()) / max(len(records), 1):.3f}"
    return (
        f"{share} ({', '.join(f'{reason} {count}' for reason, count in sorted(reasons.items()))})" if reasons else share
    )


def summarize(records: list[EpisodeRecord], seconds: float) -> str:
    """A text table of the run (with several episodes per task, their :func:`pass_at_k` too)."""
    n = len(records)
    tokens = sum(r.generated_tokens for r in records)
    # where the env reports the format, an episode without it (a rejected action, a truncation) did not follow it
    fmt = [bool(r.format_ok) for r in records] if any(r.format_ok is not None for r in records) else []
    tasks = {(r.seed, r.index) for r in records}  # several episodes per task: pass@k rows
    rows = [
        ("episodes", f"{n}"),
        ("accuracy (success rate)", f"{np.mean([r.success for r in records]):.3f}"),
        ("mean reward", f"{np.mean([r.reward for r in records]):.3f}"),
        ("mean turns", f"{np.mean([r.turns for r in records]):.2f}"),
        ("invalid actions / episode", f"{np.mean([r.invalid_actions for r in records]):.2f}"),
        ("format followed", f"{np.mean(fmt):.3f}" if fmt else "n/a"),
        ("truncated", _truncations(records)),
        *[
            (label, f"{np.mean([r.final_info.get(key) or 0.0 for r in records]):.3f}")  # absent: no answer given
            for key, label in (("em", "exact match"), ("f1", "token F1"), ("num_searches", "searches / episode"))
            if any(isinstance(r.final_info.get(key), (int, float)) for r in records)
        ],
        *[
            (label, f"{np.mean([getattr(r, name) for r in records]):.2f}")
            for name, label in (
                ("context_segments", "new context segments / episode"),
                ("summaries", "summaries / episode"),
            )
            if any(getattr(r, name) for r in records)
        ],
        *[(f"pass@{k}", f"{value:.3f}") for k, value in pass_at_k(records).items() if len(records) > len(tasks)],
        ("generated tokens", f"{tokens}"),
        ("wall time (s)", f"{seconds:.1f}"),
        ("generated tokens / s", f"{tokens / max(seconds, 1e-9):.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
