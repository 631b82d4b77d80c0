"""``rl2/Remote-v0``: an env served by another process or machine, played as a local one.

``gym.make("rl2/Remote-v0", url="http://127.0.0.1:8000")`` talks to a server started with
``python -m rl2gem.envserver ENV_ID`` (:mod:`rl2gem.serving.env_server`, OpenEnv's contract with
sessions): each :class:`RemoteEnv` holds one session there, ``reset`` / ``step`` are its
``/reset`` / ``/step`` calls, and what comes back is what the served env returned (the
observation delta, the reward, both flags, ``info`` with its role, turn and seed). So
``make_vec``, ``check_env``, ``evaluate``, ``collect`` and ``trainers/ppo.py env=rl2/Remote-v0
env_kwargs.url=...`` work as against the env itself; kwargs other than the client's own (``split``,
a game's ``difficulty``, ...) are sent to the server, which makes the session's env with them.

Failures: a refused connection, a timeout or a 5xx is retried ``retries`` times, waiting
``backoff * 2**attempt`` seconds (a step carries a request id, so a retried step the server already
took is answered, not taken again; a reset too, so a retried reset opens one session); then the step ends the episode as truncated with
``info["error"]`` (and ``info["truncated_reason"] == "remote_error"``), and the batch goes on. A
reset that fails the same way returns an empty observation with ``info["error"]``; the episode's
first step is then that truncated step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
import uuid
from typing import Any

import aiohttp

from rl2gem.aio import LoopSessions
from rl2gem.core import Env, TextSpace
from rl2gem.env_protocol import ACTION_FIELD, ProtocolError, read_reset, read_step

__all__ = ["RemoteEnv", "RemoteEnvError"]


class RemoteEnvError(ConnectionError):
    """The server could not be reached, or refused the call; ``status`` is its HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteEnv(Env):
    """An env served at ``url`` (see the module docstring).

    Args:
        url: the env server's base URL (``http://host:port``).
        split: data split for data-set envs (sent to the server as an env kwarg when the served env
            has a ``split`` argument, dropped otherwise).
        tool_prompt: the served env's ``tool_prompt`` (``None``: its tools are left to the chat
            template, as evaluation through an API and ``rollout.tools_in_template`` ask), sent when
            the served env has that argument, dropped otherwise; not given: the server's own.
        timeout: seconds per HTTP call.
        retries: further tries of a call that got no answer or a 5xx.
        backoff: seconds before the first retry; doubled each time.
        **env_kwargs: the served env's kwargs for this session (over the server's own).

    A copy (``copy``, ``deepcopy``, ``pickle``) is allowed before the first reset and after
    :meth:`close`; it opens its own session on its first reset.

    Raises:
        ValueError: ``url`` is not an http(s) URL.
        TypeError: a copy while a session is open: its episode lives on the server.
    """

    def __init__(
        self,
        url: str,
        *,
        split: str | None = None,
        tool_prompt: str | None = "server",
        timeout: float = 60.0,
        retries: int = 4,
        backoff: float = 0.5,
        render_mode: str | None = None,
        **env_kwargs: Any,
    ):
        super().__init__(render_mode=render_mode)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL of an env server, got {url!r}")
        self.url = url.rstrip("/")
        self.env_kwargs = {**env_kwargs, **({"split": split} if split is not None else {})}
        if tool_prompt != "server":
            self.env_kwargs["tool_prompt"] = tool_prompt
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.schema: dict[str, Any] | None = None
        self._http = LoopSessions(timeout=self.timeout)
        self._session_id: str | None = None
        self._failed_reset: str | None = None

    # ------------------------------------------------------------ transport
    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer of one call, retried on no answer or a 5xx.

        Raises:
            RemoteEnvError: a 4xx (not retried), or no good answer after the retries.
        """
        problem = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                request = self._http.get().request(
                    method, self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout)
                )
                async with request as response:
                    answer = await response.json(content_type=None)
                    if response.status < 400 and isinstance(answer, dict):
                        return answer
                    detail = answer.get("detail", answer) if isinstance(answer, dict) else answer
                    problem = f"{method} {path}: HTTP {response.status}: {detail}"
                    if response.status < 500:
                        raise RemoteEnvError(problem, response.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                problem = f"{method} {path}: {type(error).__name__}: {error}"
        raise RemoteEnvError(f"{self.url}: {problem} (after {self.retries + 1} tries)")

    async def _read_schema(self) -> None:
        self.schema = await self._call("GET", "/schema")
        for name in ("split", "tool_prompt"):  # trainers and evaluate pass them to every env that names them
            if name not in self.schema.get("kwargs", {name: None}):
                self.env_kwargs.pop(name, None)
        if self.env_kwargs:  # the schema of this session's env: its split's size, its max_turns
            query = urllib.parse.urlencode({"env_kwargs": json.dumps(self.env_kwargs)})
            self.schema = await self._call("GET", f"/schema?{query}")
        self.invalid_action_reward = float(self.schema.get("invalid_action_reward", 0.0))
        self.invalid_action_terminates = bool(self.schema.get("invalid_action_terminates", False))
        limit = self.schema.get("action", {}).get("properties", {}).get(ACTION_FIELD, {}).get("maxLength")
        if limit:
            self.action_space = TextSpace(int(limit))

    # ---------------------------------------------------------------- hooks
    async def _areset(self, options: dict[str, Any] | None):
        self._failed_reset = None
        body = {
            "seed": self._episode_seed,
            "options": options,
            "env_kwargs": self.env_kwargs or None,
            "request_id": uuid.uuid4().hex,  # a retried new session's reset is not a second session
        }
        try:
            if self.schema is None:
                await self._read_schema()
            try:
                answer = await self._call("POST", "/reset", {**body, "session_id": self._session_id})
            except RemoteEnvError as error:
                if error.status != 404 or self._session_id is None:
                    raise
                answer = await self._call("POST", "/reset", body)  # the session expired: a new one
            self._session_id = answer.get("session_id")
            return read_reset(answer)
        except (RemoteEnvError, ProtocolError) as error:
            self._failed_reset = str(error)
            return "", {"error": str(error)}

    async def _astep(self, action: str):
        if self._failed_reset is not None:
            return self._truncated(self._failed_reset)
        body = {"session_id": self._session_id, "action": {ACTION_FIELD: action}, "request_id": uuid.uuid4().hex}
        try:
            return read_step(await self._call("POST", "/step", body))
        except (RemoteEnvError, ProtocolError) as error:
            return self._truncated(str(error))

    async def aclose_loop(self) -> None:
        """Close the running event loop's HTTP session only: the served episode stays open, and
        the env goes on from another loop (a temporary ``asyncio.run`` that played it ends)."""
        await self._http.close()

    async def _aclose(self) -> None:
        if self._session_id is not None:
            with contextlib.suppress(RemoteEnvError):  # gone already: the server closes idle sessions itself
                await self._call("POST", "/close", {"session_id": self._session_id})
            self._session_id = None
        await self._http.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._session_id is not None:
            raise TypeError(
                f"a RemoteEnv cannot be copied or pickled while its session {self._session_id} is open: the episode "
                "lives on the server (make a new RemoteEnv and reset it with the same seed)"
            )
        return super().__getstate__()

    @staticmethod
    def _truncated(error: str):
        return "", 0.0, False, True, {"error": error, "truncated_reason": "remote_error"}

    def _begin_step(self, action: Any) -> tuple[str, str | None]:
        """The base checks (reset first, text), but any text JSON can carry (an empty or over-long
        one too) goes to the server, whose env judges it as it would locally."""
        text, reason = super()._begin_step(action)
        if reason is not None and isinstance(action, str) and _encodable(action):
            return action, None
        return text, reason

    def __len__(self) -> int:
        """The size of the served env's data set (its items are ``reset(options={"index": i})``),
        as its server reports it for this env's kwargs (``split``...).

        Raises:
            TypeError: the served env has no data set.
            RemoteEnvError: the server cannot be reached.
        """
        if self.schema is None:
            self._loop_run(self._read_schema())
        size = self.schema.get("num_items")
        if size is None:
            raise TypeError(f"the env served at {self.url} has no data set")
        return int(size)

    @property
    def session_id(self) -> str | None:
        """This env's session on the server (None before the first reset)."""
        return self._session_id

    def __repr__(self) -> str:
        return f"<rl2/Remote-v0 {self.url}>"


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 (no lone surrogates), so JSON can carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
