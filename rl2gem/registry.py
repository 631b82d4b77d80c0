"""Registration of rl2gem environments in Gymnasium's own registry.

There is one registry: :data:`gymnasium.envs.registry`. The functions here are
thin conveniences over it:

* :func:`register` registers an env with the settings text envs need
  (Gymnasium's ``PassiveEnvChecker`` and ``OrderEnforcing`` wrappers are left
  off, since they would hide ``areset``/``astep``; :class:`rl2gem.Env` enforces
  the reset/step order itself).
* :func:`make` is :func:`gymnasium.make`; :func:`make_vec` builds an
  :class:`rl2gem.vector.AsyncVectorEnv` / :class:`~rl2gem.vector.SyncVectorEnv`.
* :func:`list_envs` lists the ids registered through :func:`register`, plugins'
  included (optionally of one namespace).
* :func:`standard_kwargs` fills in the options evaluation and training set on
  every env that takes them (``split``, ``tool_prompt``); :func:`env_config_problem` builds an
  env once to check its arguments before a run loads anything.
* :func:`find_spec` is :func:`gymnasium.spec` that also takes :func:`gymnasium.make`'s
  ``"module:id"`` form (the module is imported first: a script's own envs).
* :func:`load_plugins` imports the environments other installed packages
  declare in the entry-point group ``rl2gem.envs`` (Gymnasium 1.x no longer
  loads plugins). It runs once when :mod:`rl2gem` is imported.

An entry point in the group names either a module (importing it registers its
envs) or a callable taking no arguments (calling it registers them)::

    [project.entry-points."rl2gem.envs"]
    my_envs = "my_package.envs"            # a module
    more = "my_package.envs:register_all"  # a callable
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

__all__ = [
    "register",
    "make",
    "make_vec",
    "list_envs",
    "load_plugins",
    "standard_kwargs",
    "env_config_problem",
    "env_id_problem",
    "find_spec",
    "ENTRY_POINT_GROUP",
    "NAMESPACE",
]

#: Python entry-point group scanned by :func:`load_plugins`.
ENTRY_POINT_GROUP = "rl2gem.envs"
#: Gymnasium namespace of the built-in envs.
NAMESPACE = "rl2"


def register(
    id: str,
    entry_point: str | Callable[..., gym.Env],
    *,
    nondeterministic: bool = False,
    **kwargs: Any,
) -> None:
    """Register a text env in Gymnasium's registry.

    Args:
        id: Gymnasium id, ``"namespace/Name-vN"`` (e.g. ``"rl2/Math-v0"``,
            ``"mylab/Maze-v0"``).
        entry_point: ``"package.module:Class"`` (imported lazily, on first
            ``make``) or a callable returning the env.
        nondeterministic: the env is not reproducible from a seed (e.g. it
            reads a live service); skips the determinism checks.
        **kwargs: default constructor keyword arguments; ``make(id, **kw)``
            overrides them.

    Raises:
        gymnasium.error.RegistrationError: if ``id`` is malformed.
    """
    gym.register(
        id=id,
        entry_point=entry_point,
        nondeterministic=nondeterministic,
        order_enforce=False,
        disable_env_checker=True,
        kwargs=kwargs,
    )


def make(id: str, **kwargs: Any) -> gym.Env:
    """:func:`gymnasium.make`. Unknown ids raise Gymnasium's error with its 'did you mean' hint."""
    return gym.make(id, **kwargs)


def standard_kwargs(
    id: str, kwargs: dict[str, Any] | None = None, *, split: str | None = None, tools_in_template: bool = False
) -> dict[str, Any]:
    """``kwargs`` for ``make(id, ...)`` with the common options added where the env's entry point takes them
    and ``kwargs`` does not set them already.

    Args:
        id: a registered env id.
        kwargs: the caller's keyword arguments (not modified).
        split: data split (``"train"``, ``"test"``), for envs with a ``split`` argument.
        tools_in_template: add ``tool_prompt=None`` to tool envs (their tools are then
            rendered by the chat template from ``info["tools"]``, not written into the text).

    Raises:
        gymnasium.error.Error: unknown id.
    """
    import inspect

    out = dict(kwargs or {})
    entry = find_spec(id).entry_point
    creator = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
    params = inspect.signature(creator).parameters
    if split is not None and "split" in params:
        out.setdefault("split", split)
    if tools_in_template and "tool_prompt" in params:
        out.setdefault("tool_prompt", None)
    return out


def find_spec(id: str) -> gym.envs.registration.EnvSpec:
    """:func:`gymnasium.spec`, also for the ``"module:namespace/Name-vN"`` form that
    :func:`gymnasium.make` takes (``module`` is imported first, which registers its envs).

    Raises:
        gymnasium.error.Error: an unknown id (with Gymnasium's "did you mean" hint).
        ModuleNotFoundError: ``module`` does not import.
    """
    module, _, name = id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"{id}: the module {module!r} that should register the env does not import: {e}"
            ) from e
    return gym.spec(name)


def env_id_problem(id: str) -> str | None:
    """Why ``id`` names no env (:func:`find_spec`'s error, with Gymnasium's "did you mean"
    hint), or None when it names one."""
    try:
        find_spec(id)
    except Exception as e:  # gymnasium's own errors (NameNotFound, ...), a module that does not import
        return str(e)
    return None


def env_config_problem(
    id: str, kwargs: dict[str, Any] | None = None, *, split: str | None = None, tools_in_template: bool = False
) -> str | None:
    """Why ``make(id, **standard_kwargs(id, kwargs, ...))`` fails (an unknown id or argument, a value
    the env refuses), or None when it works: the env is built once and closed. Envs parse no data
    at construction, so this is cheap (about 1 s at most, a first import)."""
    try:
        env = gym.make(id, **standard_kwargs(id, kwargs, split=split, tools_in_template=tools_in_template))
    except Exception as e:  # the env's own error is the message
        return f"{id} with {dict(kwargs or {})}: {type(e).__name__}: {e}"
    env.close()
    return None


def make_vec(
    id: str | Sequence[str],
    num_envs: int | None = None,
    *,
    vectorization_mode: str = "async",
    max_concurrency: int | None = None,
    env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Env]] = (),
    autoreset_mode: str | gym.vector.AutoresetMode = "NextStep",
    **kwargs: Any,
):
    """Build a vector env of registered text envs.

    Args:
        id: one id (repeated ``num_envs`` times) or a list of ids (mixed envs).
        num_envs: number of envs (required with a single id; with a list it
            defaults to its length).
        vectorization_mode: ``"async"`` (:class:`~rl2gem.vector.AsyncVectorEnv`)
            or ``"sync"`` (:class:`~rl2gem.vector.SyncVectorEnv`).
        max_concurrency: for ``"async"``, the most envs stepped at once.
        env_kwargs: constructor kwargs for every env, or one dict per env.
        wrappers: callables applied in order to each env.
        autoreset_mode: Gymnasium's ``AutoresetMode.NEXT_STEP`` or ``AutoresetMode.SAME_STEP``, or its
            value (``"NextStep"``, ``"SameStep"``).
        **kwargs: shared constructor kwargs (merged under ``env_kwargs``).

    Raises:
        ValueError: bad ``num_envs``/``env_kwargs`` lengths or unknown mode.
    """
    from rl2gem.vector import AsyncVectorEnv, SyncVectorEnv

    ids = [id] * (num_envs if num_envs is not None else 1) if isinstance(id, str) else list(id)
    if isinstance(id, str) and num_envs is None:
        raise ValueError("make_vec(id, num_envs): num_envs is required with a single id")
    if num_envs is not None and len(ids) != num_envs:
        raise ValueError(f"{len(ids)} ids given for num_envs={num_envs}")
    if not ids:
        raise ValueError("make_vec needs at least one env")
    if env_kwargs is None or isinstance(env_kwargs, dict):
        per_env = [dict(env_kwargs or {}) for _ in ids]
    else:
        per_env = [dict(k) for k in env_kwargs]
        if len(per_env) != len(ids):
            raise ValueError(f"env_kwargs has {len(per_env)} entries for {len(ids)} envs")

    def factory(env_id: str, kw: dict[str, Any]) -> Callable[[], gym.Env]:
        def build() -> gym.Env:
            env = gym.make(env_id, **{**kwargs, **kw})
            for wrap in wrappers:
                env = wrap(env)
            return env

        return build

    fns = [factory(i, kw) for i, kw in zip(ids, per_env, strict=True)]
    if vectorization_mode == "async":
        return AsyncVectorEnv(fns, max_concurrency=max_concurrency, autoreset_mode=autoreset_mode)
    if vectorization_mode == "sync":
        return SyncVectorEnv(fns, autoreset_mode=autoreset_mode)
    raise ValueError(f"vectorization_mode must be 'async' or 'sync', got {vectorization_mode!r}")


def list_envs(namespace: str | None = None) -> list[str]:
    """Sorted ids of the envs registered through :func:`register`: the built-in
    ones, plugins' (:func:`load_plugins`) and any registered by hand.

    They are recognised by their specs' settings, without importing any env
    module; Gymnasium's own envs (``CartPole-v1``, ...) are not listed.

    Args:
        namespace: only ids in this Gymnasium namespace (``"rl2"``: the
            built-in envs; ``"acme"``: ``acme/...``). ``None``: all of them.
    """
    return sorted(
        k
        for k, s in gym.registry.items()
        if s.disable_env_checker and not s.order_enforce and (namespace is None or s.namespace == namespace)
    )


_plugins_loaded = False


def load_plugins(*, force: bool = False) -> list[str]:
    """Import every entry point of the group ``rl2gem.envs``.

    A plugin that fails to load is reported with a :class:`RuntimeWarning`
    (naming the distribution and the error) and skipped, so one broken
    package cannot break ``import rl2gem``.

    Returns:
        the names of the entry points loaded.
    """
    global _plugins_loaded
    if _plugins_loaded and not force:
        return []
    _plugins_loaded = True
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            before, imported = dict(gym.registry), ep.module in sys.modules  # imported: it registered then
            obj = ep.load()
            if callable(obj) and not isinstance(obj, types.ModuleType):
                obj()
            loaded.append(ep.name)
            registered = len(gym.registry) != len(before) or any(gym.registry[k] is not v for k, v in before.items())
            if not registered and not (imported and not ep.attr):
                hint = (
                    ""
                    if ep.attr
                    else f": point it at the function that registers them, e.g. '{ep.value}:register_envs'"
                )
                warnings.warn(
                    f"rl2gem: env plugin {ep.name!r} = {ep.value!r} registered no env (a module registers its "
                    f"envs when imported, a function when called){hint}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        except Exception as e:
            dist = getattr(ep, "dist", None)
            warnings.warn(
                f"rl2gem: could not load env plugin {ep.name!r} = {ep.value!r}"
                f"{f' from {dist.name}' if dist else ''}: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
    return loaded
