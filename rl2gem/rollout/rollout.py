"""Multi-turn rollouts over rl2gem envs: GRPO groups, TITO sequences, partial rollouts.

Every episode runs as its own coroutine (``env.areset`` / ``engine.generate`` /
``env.astep`` ...), so a slow env or a long answer never holds up the others.
``responses_per_prompt`` episodes share one initial state (same env seed): the
group a GRPO-style estimator normalises over. A global semaphore bounds the
generate calls in flight.

Partial rollouts (``partial_rollout=True``): :meth:`Rollout.collect` returns as
soon as ``num_groups`` groups are complete, keeping ``num_groups`` groups in
flight until then. It then pauses the engine: in-flight requests come back with
the tokens generated so far (``finish_reason == "abort"``), their episodes keep
those tokens and log-probabilities and wait; the next ``collect`` resumes them
(under whatever weights the engine has by then) and they finish. Every action
token records the weight version that produced it, so the trainer can correct
off-policy tokens with importance sampling against the rollout log-probs; a
group whose oldest token is more than ``max_staleness`` versions behind is
dropped (counted in ``rollout/dropped_stale``).

Dynamic filtering (``dynamic_filter=True``, DAPO): a group whose rewards are
all equal carries no GRPO signal; it is dropped, more groups are sampled (at
most ``max_groups_factor`` x ``num_groups`` per call) and the filtered ratio
is logged.

Env errors (``env_errors="drop"``, the default): an env that raises in ``areset`` or ``astep``
ends its episode. In :meth:`Rollout.collect` the episode's group is dropped (it would train on a
reward the env never gave), counted in ``rollout/env_error_groups`` and replaced by a new group;
each distinct error is warned once, with its traceback. More failed groups in one call than it
collects is an :class:`EnvError` (something is broken, not an unlucky episode). In
:meth:`Rollout.play` (evaluation) the episode is kept, truncated, with ``info["error"]`` and
``truncated_reason="env_error"``. ``env_errors="raise"``: the :class:`EnvError` ends the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from rl2gem.registry import standard_kwargs
from rl2gem.rollout.context import CONTINUE_PROMPT, SUMMARY_PROMPT, ContextConfig, truncated_messages
from rl2gem.rollout.engines.base import Engine, EngineError, SamplingParams, mix_seed
from rl2gem.rollout.tito import ChatRenderer, Episode, Sequence

__all__ = ["EnvError", "warn_env_error", "Rollout", "RolloutBatch", "RolloutConfig", "reply_messages", "reward_metrics"]

ENV_ERROR_POLICIES = ("drop", "raise")


class EnvError(RuntimeError):
    """An env raised in ``areset`` or ``astep`` during a rollout. The message names the env, the
    call, the episode's seed and turn, and the env's own error, which is ``__cause__``."""

    @classmethod
    def raised(cls, env: str, where: str, error: Exception) -> EnvError:
        """The EnvError of ``error``, raised by ``env`` (its repr or id) in ``where`` (the call,
        the seed and turn)."""
        wrapped = cls(f"{env} {where} raised {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped


def warn_env_error(error: EnvError, seen: set[tuple[str, str]]) -> None:
    """Warn of an env error that ``env_errors="drop"`` goes past, with the env's traceback, once
    per distinct error (its type and message; ``seen`` holds those warned)."""
    cause = error.__cause__ or error
    key = (type(cause).__name__, str(cause))
    if key in seen:
        return
    seen.add(key)
    trace = "".join(traceback.format_exception(cause)).rstrip()
    warnings.warn(
        f"{error} (env_errors=drop: the episode ends here; this error is not warned again)\n{trace}",
        RuntimeWarning,
        stacklevel=3,
    )


#: mixed into a seeded episode's seed for a managed context's summary, asked at the turn of the
#: next action, whose request would otherwise draw the same uniforms token for token
SUMMARY_SEED = 0x5EED


@dataclasses.dataclass
class RolloutConfig:
    """Rollout settings (names follow RL2 / verl).

    Attributes:
        responses_per_prompt: episodes per group (GRPO group size).
        max_new_tokens: token budget of one action.
        max_length: token budget of one sequence (prompt + actions + replies);
            an episode that reaches it is truncated (``truncated_reason="max_length"``).
        temperature, top_p, top_k: sampling (see :class:`SamplingParams`).
        concurrency: generate calls in flight at once.
        partial_rollout: see module docstring.
        partial_oversample: with partial rollouts, keep ``(1 + x) * num_groups``
            groups in flight (more overlap between steps, more carried over).
        max_staleness: versions an episode's oldest token may lag behind.
        dynamic_filter: drop groups with equal rewards (DAPO).
        max_groups_factor: bound on groups started per call with dynamic filtering.
        system_prompt: system message of every conversation.
        tools_in_template: render the tool schemas an env offers in its reset
            ``info["tools"]`` with the chat template (``tools=``, the model's own
            tool format, e.g. Qwen2.5/Hermes) instead of relying on the env's text.
            Make such envs with ``tool_prompt=None`` so the tools are not offered
            twice. Needs a template that reads ``tools`` (``ValueError`` otherwise).
        seed: base of the per-group env seeds and of the per-request sampling seeds
            (``sampling_seed``: a group's samples are the same whatever the batching).
        progress: show a tqdm bar.
        context: managed context (:class:`rl2gem.rollout.context.ContextConfig`, or its keys as
            a mapping): a segment budget and ``truncate`` / ``summarize`` when it is reached.
        env_errors: ``"drop"`` (a group whose env raised is dropped and replaced; an evaluation
            episode is kept, truncated, with ``info["error"]``) or ``"raise"`` (see the module doc).
    """

    responses_per_prompt: int = 4
    max_new_tokens: int = 256
    max_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    concurrency: int = 64
    partial_rollout: bool = False
    partial_oversample: float = 0.0
    max_staleness: int = 1
    dynamic_filter: bool = False
    max_groups_factor: float = 4.0
    system_prompt: str | None = None
    tools_in_template: bool = False
    seed: int = 0
    progress: bool = False
    context: ContextConfig = dataclasses.field(default_factory=ContextConfig)
    env_errors: str = "drop"

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the field of a value that cannot work (a count below 1, a
        negative temperature, a ``top_p`` outside (0, 1], a bad ``context``)."""
        self.context = ContextConfig.from_value(self.context)
        for name in ("responses_per_prompt", "max_new_tokens", "max_length", "concurrency", "max_staleness"):
            value, least = getattr(self, name), 0 if name == "max_staleness" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.partial_oversample, (int, float)) or self.partial_oversample < 0:
            raise ValueError(f"partial_oversample must be >= 0, got {self.partial_oversample!r}")
        if not isinstance(self.max_groups_factor, (int, float)) or self.max_groups_factor < 1:
            raise ValueError(f"max_groups_factor must be >= 1, got {self.max_groups_factor!r}")
        if self.env_errors not in ENV_ERROR_POLICIES:
            raise ValueError(f"env_errors must be one of {ENV_ERROR_POLICIES}, got {self.env_errors!r}")
        if self.context.max_tokens is not None and self.context.max_tokens <= self.max_new_tokens:
            raise ValueError(
                f"context.max_tokens={self.context.max_tokens} leaves no room for a prompt beside an action of "
                f"max_new_tokens={self.max_new_tokens} tokens"
            )

    @classmethod
    def from_mapping(cls, section: Any, *, known: Iterable[str] | None = None, **overrides: Any) -> RolloutConfig:
        """The one place a config section becomes a :class:`RolloutConfig`: every key of
        ``section`` (a dict or an OmegaConf node) that names a field is taken; ``overrides`` win.
        With ``known`` (a trainer's ``rollout:`` section: the keys the caller reads itself, such as
        ``prompts_per_rollout``) any other key is an error; without it (a whole command's config,
        as the eval CLI's) keys that are not fields are ignored.

        Raises:
            TypeError: an override that is not a field.
            ValueError: with ``known``, a key of ``section`` that is neither a field nor known.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise TypeError(f"RolloutConfig has no field(s) {bad}")
        items = section.items() if hasattr(section, "items") else []
        if known is not None:
            unknown = sorted(k for k, _ in items if k not in names and k not in set(known))
            if unknown:
                raise ValueError(f"rollout: {unknown} are not rollout settings (fields: {sorted(names)})")
        values = {k: v for k, v in items if k in names}
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass
class RolloutBatch:
    """The result of one :meth:`Rollout.collect`: complete groups and metrics."""

    groups: list[list[Episode]]
    metrics: dict[str, float]

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]

    @property
    def sequences(self) -> list[Sequence]:
        return [s for e in self.episodes for s in e.sequences]


def reward_metrics(groups: list[list[Episode]]) -> dict[str, float]:
    """The reward statistics of rollout groups (episodes' final rewards, as they are now):
    ``rollout/reward`` (mean), ``rollout/success`` (share the env called a success,
    ``info["success"]`` of the last step, else share of rewards > 0), ``rollout/zero_variance_groups``
    (share of groups of 2 or more whose samples all got the same reward: a group baseline gives
    them zero advantage) and ``rollout/group_reward_std`` (mean population std within a group).
    Recompute them after anything that changes rewards (reward model, objectives, transform).

    A statistic without anything to average is left out, not reported as 0: no episodes (dynamic
    filtering kept no group) gives ``{}``, and no group of 2 or more leaves out the group keys, so
    that a plot or a mean over steps does not read a missing value as a zero reward.
    """
    eps = [e for g in groups for e in g]
    if not eps:
        return {}
    multi = [[e.reward for e in g] for g in groups if len(g) > 1]  # groups with a within-group baseline
    out = {
        "rollout/reward": sum(e.reward for e in eps) / len(eps),
        # the env's own verdict: a shaped or raw reward above 0 is not a success
        "rollout/success": sum(bool(e.info.get("success", e.reward > 0)) for e in eps) / len(eps),
    }
    if multi:
        out["rollout/zero_variance_groups"] = sum(len(set(r)) == 1 for r in multi) / len(multi)
        out["rollout/group_reward_std"] = sum(statistics.pstdev(r) for r in multi) / len(multi)
    return out


class _Group:
    __slots__ = ("gid", "episodes", "task")

    def __init__(self, gid: int):
        self.gid = gid
        self.episodes: list[Episode] = []
        self.task: asyncio.Task | None = None

    def min_version(self) -> int | None:
        vs = [min(e.versions) for e in self.episodes if e.versions]
        pend = [min(e.info["_pending_versions"]) for e in self.episodes if e.info.get("_pending_versions")]
        vs += pend
        return min(vs) if vs else None


def reply_messages(obs: str, info: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of an env reply: one ``role="tool"`` message per result where a tool
    env lists them in ``info["tool_results"]`` (chat templates wrap each result on its own),
    else one message of ``info["role"]`` (default ``"user"``) with the observation.

    Args:
        obs: the observation ``step`` returned.
        info: the info ``step`` returned.

    Returns:
        ``{"role", "content"}`` dicts, at least one.
    """
    results = info.get("tool_results")
    if info.get("role") == "tool" and isinstance(results, (list, tuple)) and results:
        return [{"role": "tool", "content": str(t)} for t in results]
    return [{"role": info.get("role", "user"), "content": obs}]


_reply_messages = reply_messages  # the former private name


#: seconds a partial-rollout pause waits for the requests it cut to answer (the embedded engine's
#: answer at once; a remote one's take a round trip), so their aborts count in that collect's metrics
PAUSE_ANSWER_SECONDS = 5.0
#: ... and how long without any answer ends that wait (the requests left are queued, not cut)
PAUSE_QUIET_SECONDS = 0.2


class Rollout:
    """Collects groups of multi-turn episodes from an engine and an env.

    Args:
        engine: any :class:`~rl2gem.rollout.engines.base.Engine`.
        tokenizer: the policy's tokenizer (its chat template renders turns).
        env: a registered env id (``"rl2/GSM8K-v0"``) or a zero-argument factory.
        config: :class:`RolloutConfig`.
        env_kwargs: keyword arguments of ``rl2gem.make``.
        chat_template: overrides the tokenizer's template.
        filter_rewards: with ``dynamic_filter``, the rewards a group is trained on, from its
            episodes (a trainer's reward objectives and transform, applied after :meth:`collect`):
            the filter drops the groups where these are all equal. None: the env's rewards.

    Use it from one event loop (episodes carried over by partial rollouts live
    on it between calls).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        env: str | Callable[[], Any],
        config: RolloutConfig | None = None,
        *,
        env_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        filter_rewards: Callable[[list[Episode]], list[float]] | None = None,
    ):
        self.engine = engine
        self.filter_rewards = filter_rewards
        self.config = config or RolloutConfig()
        if self.config.responses_per_prompt < 1:
            raise ValueError("responses_per_prompt must be >= 1")
        self.renderer = ChatRenderer(tokenizer, chat_template, self.config.system_prompt)
        if self.config.tools_in_template and not self.renderer.supports_tools:
            raise ValueError(
                "tools_in_template=True, but the chat template does not render tools (it never reads 'tools'); "
                "pass a chat_template= that does, or leave the tools in the env's text"
            )
        if isinstance(env, str):
            import rl2gem

            env_id, kwargs = env, dict(env_kwargs or {})
            if self.config.tools_in_template:  # the template renders the tools: not the env's text too
                if kwargs.get("tool_prompt") is not None:
                    warnings.warn(
                        f"{env_id} with tool_prompt={kwargs['tool_prompt']!r} and tools_in_template=True: the tool "
                        "schemas are rendered twice (the system turn and the env's text); leave tool_prompt out",
                        stacklevel=2,
                    )
                kwargs = standard_kwargs(env_id, kwargs, tools_in_template=True)
            self._env_fn = lambda: rl2gem.make(env_id, **kwargs)
        else:
            self._env_fn = env
        self._pool: list[Any] = []
        self._all_envs: list[Any] = []
        # id(env) -> its reset or step running now, shielded: a cancelled episode's env finishes
        # that call before the env is reset for another episode
        self._env_calls: dict[int, asyncio.Future] = {}
        # generate requests awaiting the engine, and an event set whenever one of them returns
        self._requests_out = 0
        self._request_back = asyncio.Event()
        self._next_gid = 0
        self._inflight: dict[int, _Group] = {}
        self._ready: list[_Group] = []  # completed but not yet returned (partial rollouts)
        self._restart: list[int] = []  # group ids to relaunch (in flight at a checkpoint)
        self._env_errors_seen: set[tuple[str, str]] = set()  # (type, message) of each env error warned
        self._warned: set[str] = set()  # the other warnings given once
        self._unchanged: set[int] = set()  # versions whose weights are the previous version's
        self._gate = asyncio.Event()
        self._gate.set()
        self._sem: asyncio.Semaphore | None = None
        self.stats: Counter = Counter()
        c = self.config
        self._params = SamplingParams(
            max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k
        )

    # ------------------------------------------------------------------ envs
    def _env(self):
        if self._pool:
            return self._pool.pop()
        env = self._env_fn()
        self._all_envs.append(env)
        return env

    async def _on_env(self, env, call: Awaitable, where: str):
        """Await ``call`` (``env``'s reset or step), shielded from cancellation: a compute-only env
        steps in a worker thread that a cancel does not stop, and an async env's step cancelled
        half-way would leave its episode state half-written.

        Raises:
            EnvError: the env raised; the message names it and ``where`` (call, seed, turn).
        """
        task = asyncio.ensure_future(call)
        self._env_calls[id(env)] = task
        try:
            return await asyncio.shield(task)
        except Exception as error:
            raise EnvError.raised(repr(env), where, error) from error
        finally:
            if task.done():
                self._env_calls.pop(id(env), None)

    def _release(self, env) -> None:
        """Give ``env`` back to the pool, once the call a cancelled episode left running ends."""
        running = self._env_calls.pop(id(env), None)
        if running is None or running.done():
            self._pool.append(env)
            return

        def finished(call: asyncio.Future) -> None:
            if not call.cancelled():
                call.exception()  # retrieved: nobody awaits it any more
            self._pool.append(env)

        running.add_done_callback(finished)
        self._env_calls[id(env)] = running  # close() waits for it

    async def close(self) -> None:
        """Cancel carried-over episodes, let the env calls they left running end, close every env."""
        for g in list(self._inflight.values()):
            if g.task is not None:
                g.task.cancel()
        await asyncio.gather(*(g.task for g in self._inflight.values() if g.task), return_exceptions=True)
        self._inflight.clear()
        await asyncio.gather(*self._env_calls.values(), return_exceptions=True)
        self._env_calls.clear()
        for env in self._all_envs:
            await env.aclose()
        self._all_envs.clear()
        self._pool.clear()

    # ------------------------------------------------------------------ episodes
    async def _generate(self, ids: list[int], max_new: int, episode: Episode, summary: bool = False):
        """One action: generate from ``ids`` until a stop or ``max_new`` tokens, resuming after a
        partial-rollout pause (the tokens so far kept) and retrying a failed request up to 3 times.
        A seeded episode's request draws from a seed of its turn and tokens so far; ``summary`` (a
        managed context's summary, asked at the turn of the next action) from another.
        Returns ``(token ids, log-probs, policy versions, finish reason)``."""
        out_ids: list[int] = []
        out_logprobs: list[float] = []
        out_versions: list[int] = []
        failures = 0
        while True:
            await self._gate.wait()
            seed = None
            if episode.sampling_seed is not None:
                parts = (episode.sampling_seed, episode.turns, len(out_ids)) + ((SUMMARY_SEED,) if summary else ())
                seed = mix_seed(*parts)
            params = dataclasses.replace(self._params, max_new_tokens=max_new - len(out_ids), sampling_seed=seed)
            async with self._sem:
                if not self._gate.is_set():
                    continue
                self.stats["requests"] += 1
                self._requests_out += 1
                try:
                    out = await self.engine.generate(ids + out_ids, params)
                finally:
                    self._requests_out -= 1
                    self._request_back.set()
            out_ids += out.output_ids
            out_logprobs += out.output_logprobs
            out_versions += [out.weight_version] * len(out.output_ids)
            episode.info["_pending_versions"] = out_versions
            if out.aborted and len(out_ids) < max_new:
                self.stats["aborted_requests"] += 1
                episode.aborts += 1
                if self._gate.is_set():  # not our pause: the engine failed the request
                    failures += 1
                    if failures > 3:
                        raise EngineError(f"generation aborted repeatedly: {out.finish_reason}")
                continue
            episode.info.pop("_pending_versions", None)
            return out_ids, out_logprobs, out_versions, out.finish_reason.get("type", "stop")

    async def _episode(self, env, observation: str, info: dict, episode: Episode) -> Episode:
        """Play ``episode`` on ``env`` from its reset ``observation`` and ``info``: token in, token
        out, each turn's reply appended as a template delta (a new sequence where the template is
        not append-only, or a new segment where the context is managed and full)."""
        config, renderer = self.config, self.renderer
        messages = renderer.initial_messages(observation, info.get("role", "user"))
        task_length = len(messages)
        tools = info.get("tools") if config.tools_in_template else None
        sequence = Sequence()
        sequence.extend_context(renderer.prompt_ids(messages, tools))
        episode.sequences.append(sequence)
        if not config.context.fits(len(sequence), config.max_new_tokens) and "first prompt" not in self._warned:
            self._warned.add("first prompt")
            warnings.warn(
                f"rollout.context.max_tokens={config.context.max_tokens} is less than an episode's first prompt "
                f"({len(sequence)} tokens) and an action (max_new_tokens={config.max_new_tokens}): its first segment "
                "runs past the limit, and the episode ends after its first turn (truncated: context)",
                stacklevel=2,
            )
        while True:
            budget = config.max_length - len(sequence)
            if budget <= 0:
                episode.truncated = True
                episode.info = {**episode.info, "truncated_reason": "max_length"}
                if not sequence.num_action_tokens:  # a prompt over the limit: nothing of it trains,
                    sequence.truncate(config.max_length)  # so no forward goes past max_length for it
                break
            max_new = min(config.max_new_tokens, budget)
            ids, logprobs, versions, finish = await self._generate(sequence.input_ids, max_new, episode)
            sequence.extend_action(ids, logprobs, versions)
            text = renderer.decode(ids)
            if finish == "length" and max_new < config.max_new_tokens:
                # the episode's token budget, not the model, cut this action: the env never sees it
                # (a fragment scored as an invalid move, or a guess, the model did not make)
                episode.finish_reasons.append(finish)
                episode.action_lengths.append(len(ids))
                episode.truncated = True
                episode.info = {**episode.info, "truncated_reason": "max_length"}
                episode.messages = messages + [{"role": "assistant", "content": text}]
                break
            where = f"astep (seed {episode.info.get('seed')}, turn {episode.turns + 1})"
            observation, reward, terminated, truncated, info = await self._on_env(env, env.astep(text), where)
            episode.turns += 1
            episode.turn_rewards.append(float(reward))
            episode.finish_reasons.append(finish)
            episode.action_lengths.append(len(ids))
            sequence.add_reward(reward)
            kept = {key: value for key, value in episode.info.items() if key in ("seed", "index")}
            episode.info = {**kept, **info}
            assistant = {"role": "assistant", "content": text}
            if terminated or truncated:
                episode.terminated, episode.truncated = bool(terminated), bool(truncated)
                episode.messages = messages + [assistant]
                break
            replies = reply_messages(observation, info)
            stop = ids[-1] if finish == "stop" and ids else None
            delta = renderer.delta(messages, text, replies, stop, tools)
            length = len(delta.ids) if delta.split else len(sequence) + len(delta.ids)  # the next prompt's
            if not config.context.fits(length, config.max_new_tokens):
                segment = await self._next_segment(
                    episode, sequence, messages[:task_length], messages, (text, replies, stop), tools
                )
                if segment is None:
                    episode.truncated = True
                    episode.info = {**episode.info, "truncated_reason": "context"}
                    episode.messages = messages + [assistant] + replies
                    break
                sequence, messages = segment
                continue
            if length + 1 > config.max_length:  # no room for an action after the reply: not appended
                episode.truncated = True
                episode.info = {**episode.info, "truncated_reason": "max_length"}
                episode.messages = messages + [assistant] + replies
                break
            messages = messages + [assistant] + replies
            if delta.split:
                episode.splits += 1
                sequence = Sequence()
                episode.sequences.append(sequence)
            sequence.extend_context(delta.ids)
        episode.messages = episode.messages or messages
        return episode

    async def _next_segment(self, episode: Episode, sequence: Sequence, task, messages, turn, tools):
        """A new segment (:mod:`rl2gem.rollout.context`) after the action ``turn = (text, replies,
        stop token)`` of the full ``sequence`` (``messages`` before the action, the first of them
        the ``task``): ``(its sequence, its messages)``, appended to the episode, or None when
        the task and the last turn do not fit ``context.max_tokens``."""
        context, renderer = self.config.context, self.renderer
        text, replies, stop = turn
        history = messages + [{"role": "assistant", "content": text}] + replies
        kept = None
        if context.policy == "summarize":
            request = renderer.delta(
                messages, text, [*replies, {"role": "user", "content": SUMMARY_PROMPT}], stop, tools
            )
            room = self.config.max_length - len(sequence) - len(request.ids)  # past max_tokens: it reads the reply
            if not request.split and room > 0:
                sequence.extend_context(request.ids)
                ids, logprobs, versions, _ = await self._generate(
                    sequence.input_ids, min(context.summary_max_new_tokens, room), episode, summary=True
                )
                sequence.extend_action(ids, logprobs, versions)
                sequence.summary = True
                episode.summaries += 1
                summary = {"role": "assistant", "content": renderer.decode(ids)}
                kept = task + [summary, {"role": "user", "content": CONTINUE_PROMPT}]
                if not context.fits(len(renderer.prompt_ids(kept, tools)), self.config.max_new_tokens):
                    kept = None  # the task and summary leave no room for an action: truncate instead
        if kept is None:  # truncate, or no room left to ask for a summary
            budget = context.max_tokens - self.config.max_new_tokens
            kept = truncated_messages(history, len(task), lambda m: len(renderer.prompt_ids(m, tools)), budget)
            if kept is None:
                return None
        segment = Sequence()
        segment.extend_context(renderer.prompt_ids(kept, tools))
        episode.sequences.append(segment)
        episode.segments += 1
        return segment, kept

    async def _group(self, g: _Group) -> _Group:
        n = self.config.responses_per_prompt
        seed = (self.config.seed * 1_000_003 + g.gid) % (2**31)
        g.episodes = [Episode(group=g.gid, sampling_seed=mix_seed(self.config.seed, g.gid, j)) for j in range(n)]
        plays = [asyncio.ensure_future(self._play(seed, None, ep)) for ep in g.episodes]
        try:
            await asyncio.gather(*plays)
        except BaseException:  # an episode failed, or the group was cancelled: none of it plays on
            for play in plays:
                play.cancel()
            await asyncio.gather(*plays, return_exceptions=True)
            raise
        return g

    async def _play(self, seed: int | None, options: dict | None, ep: Episode) -> Episode:
        env = self._env()
        try:
            obs, info = await self._on_env(env, env.areset(seed=seed, options=options), f"areset (seed {seed})")
            ep.info = {"seed": info.get("seed"), **({"index": info["index"]} if "index" in info else {})}
            return await self._episode(env, obs, info, ep)
        finally:
            self._release(env)

    async def play(
        self, resets: list[tuple[int | None, dict | None]], on_episode: Callable[[int, Episode], None] | None = None
    ) -> list[Episode]:
        """Play one episode per ``(seed, options)`` (evaluation: ``options={"index": i}`` walks a
        data set in order), each as its own coroutine under the concurrency limit.

        Args:
            on_episode: called with ``(position, episode)`` as each one finishes (stream results to disk).

        Returns:
            the episodes, in the order of ``resets``.
        """
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.concurrency)
        if not self._gate.is_set():
            await self.engine.resume()
            self._gate.set()

        async def one(i, seed, options):
            ep = Episode(group=i, sampling_seed=mix_seed(self.config.seed, -1 - i))
            try:
                await self._play(seed, options, ep)
            except EnvError as error:
                if self.config.env_errors == "raise":
                    raise
                self._warn_env_error(error)
                ep.truncated = True
                task = {"seed": seed, **({"index": options["index"]} if options and "index" in options else {})}
                ep.info = {**task, **ep.info, "error": str(error), "truncated_reason": "env_error"}  # a reset's too
            if on_episode is not None:
                on_episode(i, ep)
            return ep

        return list(await asyncio.gather(*(one(i, s, o) for i, (s, o) in enumerate(resets))))

    def _warn_env_error(self, error: EnvError) -> None:
        warn_env_error(error, self._env_errors_seen)

    def _take_finished(self, done: set, ready: list[_Group], m: Counter, num_groups: int) -> int:
        """Move the groups of the finished tasks ``done`` from in flight to ``ready``; returns how
        many were dropped for an env error (each one's place goes to a new group)."""
        dropped = 0
        for task in done:
            g = next(x for x in self._inflight.values() if x.task is task)
            del self._inflight[g.gid]
            finished = self._finished(task, m, num_groups)
            if finished is None:
                dropped += 1
            else:
                ready.append(finished)
        return dropped

    def _finished(self, task: asyncio.Future, m: Counter, num_groups: int) -> _Group | None:
        """The group of a finished group ``task``, or None when its env raised and
        ``env_errors="drop"`` drops it (counted in ``m["env_error_groups"]``).

        Raises:
            EnvError: the env raised and ``env_errors="raise"``, or more groups of this call
                failed than it collects.
            Exception: what else the group raised (the engine's errors).
        """
        error = None if task.cancelled() else task.exception()
        if not isinstance(error, EnvError) or self.config.env_errors == "raise":
            return task.result()
        m["env_error_groups"] += 1
        if m["env_error_groups"] > num_groups:
            raise EnvError(
                f"{m['env_error_groups']} groups failed in their env in one collect of {num_groups}: something "
                f"is broken, not an unlucky episode (the last: {error})"
            ) from error
        self._warn_env_error(error)
        return None

    def _launch(self, gid: int | None = None) -> _Group:
        if gid is None:
            gid, self._next_gid = self._next_gid, self._next_gid + 1
        g = _Group(gid)
        g.task = asyncio.ensure_future(self._group(g))
        self._inflight[g.gid] = g
        return g

    # ------------------------------------------------------------------ policy versions
    def weights_unchanged(self, version: int) -> None:
        """Say that policy ``version`` has the weights of ``version - 1`` (a trainer step that
        updated nothing, its weights relabelled): tokens sampled at ``version - 1`` are no staler
        for it (:meth:`staleness`)."""
        self._unchanged.add(int(version))

    def staleness(self, oldest: int, version: int) -> int:
        """Weight changes between policy ``oldest`` and ``version``: the versions in
        ``(oldest, version]`` not marked by :meth:`weights_unchanged`. What ``max_staleness``
        bounds."""
        return sum(1 for v in range(oldest + 1, version + 1) if v not in self._unchanged)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The data position and the partial-rollout buffer, picklable.

        ``next_gid`` (the next group id: env seeds and sampling seeds follow from
        it), the completed surplus groups with all their tokens, the ids of
        groups carried over in flight, and the versions marked by
        :meth:`weights_unchanged`. Call between :meth:`collect` calls.
        """
        return {
            "next_gid": self._next_gid,
            "ready": [(g.gid, g.episodes) for g in self._ready],
            "in_flight": sorted(self._inflight),
            "unchanged_versions": sorted(self._unchanged),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Completed surplus groups come back as they were;
        groups that were in flight (partial rollouts) restart from their first token under
        the current weights with the same env seed and sampling seeds (their carried tokens
        were never trained on, so nothing trained is lost; their old-policy prefix is).

        Raises:
            RuntimeError: episodes are running on this rollout.
        """
        if self._inflight:
            raise RuntimeError("load_state_dict needs a rollout with no groups in flight")
        self._next_gid = int(state["next_gid"])
        self._ready = []
        for gid, episodes in state.get("ready", []):
            g = _Group(gid)
            g.episodes = episodes
            self._ready.append(g)
        self._restart = list(state.get("in_flight", []))
        self._unchanged = set(state.get("unchanged_versions", []))

    # ------------------------------------------------------------------ collect
    async def collect(self, num_groups: int) -> RolloutBatch:
        """Run until ``num_groups`` complete groups are ready (see module docstring).

        Returns:
            :class:`RolloutBatch` with ``num_groups`` groups (fewer only when
            dynamic filtering hit ``max_groups_factor``), in the order they were started (group
            id: the same order in every run of the same seeds), and its metrics.

        Raises:
            ValueError: ``num_groups < 1``.
            EngineError: the engine failed a request repeatedly, or reported an older policy
                version than it was at for a group started in this call (which would drop every
                group as stale).
            EnvError: an env raised in an episode and ``env_errors="raise"``, or more groups
                failed in their env than ``num_groups`` (``"drop"``). The failed group's other
                episodes are cancelled first (their env calls end before the envs are reused),
                and the groups this call had finished are returned by the next call.
        """
        if num_groups < 1:
            raise ValueError("num_groups must be >= 1")
        c = self.config
        if self._sem is None:
            self._sem = asyncio.Semaphore(c.concurrency)
        t0 = time.perf_counter()
        before = Counter(self.stats)
        version = int(getattr(self.engine, "weight_version", 0))
        m = Counter()
        # carried-over groups that are already too stale are dropped now
        for g in list(self._inflight.values()):
            mv = g.min_version()
            if mv is not None and self.staleness(mv, version) > c.max_staleness:
                g.task.cancel()
                del self._inflight[g.gid]
                m["dropped_stale"] += 1
        m["carried_over"] = len(self._inflight)
        for gid in self._restart:  # in flight when a checkpoint was taken
            self._launch(gid)
        self._restart = []
        if not self._gate.is_set():
            await self.engine.resume()
            self._gate.set()
        kept: list[_Group] = []
        launched, first_new = 0, self._next_gid  # groups from first_new on start in this call
        ready, self._ready = self._ready, []
        if c.dynamic_filter:
            budget = max(num_groups, int(c.max_groups_factor * num_groups))
        else:  # partial rollouts refill as groups complete; the in-flight target bounds them
            budget = math.inf if c.partial_rollout else num_groups
        bar = None
        if c.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_groups, desc="rollout", unit="group", leave=False)
        try:
            while len(kept) < num_groups:
                if c.partial_rollout:
                    want = math.ceil(num_groups * (1 + c.partial_oversample)) - len(kept)
                else:
                    want = num_groups - len(kept)
                while not ready and len(self._inflight) < want and launched < budget:
                    self._launch()
                    launched += 1
                if not ready:
                    if not self._inflight:
                        break
                    done, _ = await asyncio.wait(
                        [g.task for g in self._inflight.values()], return_when=asyncio.FIRST_COMPLETED
                    )
                    budget += self._take_finished(done, ready, m, num_groups)
                while ready:
                    g = ready.pop(0)
                    if len(kept) >= num_groups:
                        self._ready.append(g)  # surplus: first in line next time
                        continue
                    mv = g.min_version()
                    if mv is not None and self.staleness(mv, version) > c.max_staleness:
                        if g.gid >= first_new:  # sampled after this call began, at `version`
                            raise EngineError(
                                f"a group started now has tokens of policy version {mv} while the engine is at "
                                f"version {version}: the engine reports versions it did not run (every group "
                                f"would be dropped as more than max_staleness={c.max_staleness} versions stale)"
                            )
                        m["dropped_stale"] += 1
                        continue
                    m["unfiltered_episodes"] += len(g.episodes)
                    m["unfiltered_reward_sum"] += sum(e.reward for e in g.episodes)
                    if c.dynamic_filter:
                        trained = self.filter_rewards(g.episodes) if self.filter_rewards else None
                        rewards = set(trained if trained is not None else (e.reward for e in g.episodes))
                    if c.dynamic_filter and len(rewards) == 1 and len(g.episodes) > 1:
                        m["filtered"] += 1
                        continue
                    kept.append(g)
                    if bar is not None:
                        bar.update(1)
        except Exception:  # a group failed (env or engine): the finished ones wait for the next call
            self._ready = kept + ready + self._ready
            raise
        finally:
            if bar is not None:
                bar.close()
        if self._inflight:
            if c.partial_rollout:
                self._gate.clear()
                await self.engine.pause("abort")
                await self._cut_requests_back()
            else:  # only with dynamic filtering: surplus groups are not needed
                for g in self._inflight.values():
                    g.task.cancel()
                await asyncio.gather(*(g.task for g in self._inflight.values()), return_exceptions=True)
                self._inflight.clear()
        # in group-id order, not completion order: the trainer's micro-batches and ranks then get the
        # same sequences in every run of the same seeds, however the engine's threads were scheduled
        groups = [g.episodes for g in sorted(kept, key=lambda g: g.gid)]
        return RolloutBatch(groups, self._metrics(groups, m, before, launched, time.perf_counter() - t0))

    async def _cut_requests_back(self) -> None:
        """Wait for the requests a pause in abort mode cut to answer, so that this collect reports
        their aborts: until none is out, or none has answered for :data:`PAUSE_QUIET_SECONDS`
        (the rest wait in the engine's queue, which a pause does not abort), at most
        :data:`PAUSE_ANSWER_SECONDS` in all."""
        deadline = time.monotonic() + PAUSE_ANSWER_SECONDS
        while self._requests_out and time.monotonic() < deadline:
            self._request_back.clear()
            try:
                await asyncio.wait_for(self._request_back.wait(), PAUSE_QUIET_SECONDS)
            except asyncio.TimeoutError:  # quiet: queued requests, not cut ones (TimeoutError from 3.11)
                return

    def _metrics(self, groups, m: Counter, before: Counter, launched: int, seconds: float) -> dict[str, float]:
        """The metrics of one :meth:`collect`. Means over the kept episodes are left out when none
        was kept; ``rollout/unfiltered_reward`` is the mean reward of every episode of the groups
        that finished in time (kept and filtered, not the stale ones), before dynamic filtering: the
        policy's own success rate, where the kept groups' mean is pulled towards the mixed groups."""
        eps = [e for g in groups for e in g]
        done = len(groups) + m["filtered"] + m["dropped_stale"]
        delta = self.stats - before
        means = {}
        if eps:
            means = {
                "rollout/response_length": sum(e.num_action_tokens for e in eps) / len(eps),
                "rollout/turns": sum(e.turns for e in eps) / len(eps),
                "rollout/context_segments": sum(e.segments for e in eps) / len(eps),
                "rollout/summaries": sum(e.summaries for e in eps) / len(eps),
                "rollout/truncated": sum(e.truncated for e in eps) / len(eps),
            }
        if m["unfiltered_episodes"]:
            means["rollout/unfiltered_reward"] = m["unfiltered_reward_sum"] / m["unfiltered_episodes"]
        return {
            "rollout/groups": float(len(groups)),
            "rollout/episodes": float(len(eps)),
            "rollout/unfiltered_episodes": float(m["unfiltered_episodes"]),
            **reward_metrics(groups),
            **means,
            "rollout/tokens": float(sum(e.num_tokens for e in eps)),
            "rollout/action_tokens": float(sum(e.num_action_tokens for e in eps)),
            "rollout/sequences": float(sum(len(e.sequences) for e in eps)),
            "rollout/splits": float(sum(e.splits for e in eps)),
            "rollout/filtered_ratio": m["filtered"] / done if done else 0.0,
            "rollout/dropped_stale": float(m["dropped_stale"]),
            "rollout/env_error_groups": float(m["env_error_groups"]),
            "rollout/carried_over": float(m["carried_over"]),
            "rollout/in_flight_after": float(len(self._inflight)),
            "rollout/ready_after": float(len(self._ready)),
            "rollout/requests": float(delta["requests"]),
            "rollout/aborted_requests": float(delta["aborted_requests"]),
            "rollout/groups_started": float(launched),
            "time/rollout": seconds,
        }


#: the :meth:`Rollout.collect` metrics that are counts (summed over ranks); the others are rates or means
SUMMED_METRICS = frozenset(
    f"rollout/{name}"
    for name in (
        "groups", "episodes", "unfiltered_episodes", "tokens", "action_tokens", "sequences", "splits", "requests",
        "aborted_requests", "groups_started", "dropped_stale", "carried_over", "in_flight_after", "ready_after",
    )
)  # fmt: skip


def merge_rank_metrics(per_rank: list[Mapping[str, float]]) -> dict[str, float]:
    """One rollout's metrics from every rank's :attr:`RolloutBatch.metrics`: counts
    (:data:`SUMMED_METRICS`) are summed; the others are averaged over the ranks that report them,
    the episode statistics (``rollout/*``) weighted by each rank's ``rollout/episodes`` (the
    ``rollout/unfiltered_*`` ones and ``rollout/filtered_ratio`` by ``rollout/unfiltered_episodes``),
    so that they are the means over all episodes (a rank whose groups dynamic filtering all dropped
    has no episodes and reports no episode means: it does not count). Keys: those of any rank, in
    order of first appearance.

    Raises:
        ValueError: ``per_rank`` is empty.
    """
    if not per_rank:
        raise ValueError("merge_rank_metrics needs the metrics of at least one rank")
    keys = list(dict.fromkeys(key for metrics in per_rank for key in metrics))
    merged = {}
    for key in keys:
        present = [metrics for metrics in per_rank if key in metrics]
        values = [metrics[key] for metrics in present]
        if key in SUMMED_METRICS:
            merged[key] = sum(values)
            continue
        before_filter = key.startswith("rollout/unfiltered_") or key == "rollout/filtered_ratio"
        count = "rollout/unfiltered_episodes" if before_filter else "rollout/episodes"
        weights = [float(metrics.get(count, 1.0)) if key.startswith("rollout/") else 1.0 for metrics in present]
        if sum(weights) <= 0:  # no rank played an episode: a plain mean of what they report
            weights = [1.0] * len(values)
        merged[key] = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    return merged
