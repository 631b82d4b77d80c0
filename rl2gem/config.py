"""``key=value`` configuration over YAML defaults (OmegaConf), with clear errors.

``load_config(defaults, argv)`` merges dot-list overrides (``actor.lr=1e-6``,
``env_kwargs.task=countdown``) over a YAML file or dict. A key that is not in
the defaults is an error naming the closest valid key (``actor.lrr`` -> did you
mean ``actor.lr``?); mappings whose default is empty (``env_kwargs``) accept
any sub-key.

``config=<recipe>`` merges a recipe YAML (a path, or a name looked up next to the
defaults: ``config=arithmetic`` -> ``arithmetic.yaml``) over the defaults before the
other overrides; its keys are checked the same way.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ConfigError",
    "load_config",
    "check_overrides",
    "check_types",
    "closest_hint",
    "config_error_exit_code",
    "config_help",
]


class ConfigError(ValueError):
    """A bad ``key=value`` argument."""


def _valid_keys(node: Any, prefix: str = "") -> tuple[set[str], set[str]]:
    """(all dotted keys, dotted keys of open mappings)."""
    keys, open_maps = set(), set()
    if isinstance(node, Mapping):
        if not node and prefix:
            open_maps.add(prefix.rstrip("."))
        for k, v in node.items():
            full = f"{prefix}{k}"
            keys.add(full)
            sub_keys, sub_open = _valid_keys(v, full + ".")
            keys |= sub_keys
            open_maps |= sub_open
    return keys, open_maps


#: Keys that moved, old -> new: an old key is an error that names the new one.
MOVED_KEYS = {"rollout.is_mode": "actor.is_mode", "rollout.is_cap": "actor.is_cap"}


def check_overrides(defaults: Mapping[str, Any], argv: list[str]) -> None:
    """Raise :class:`ConfigError` for an argument that is not ``key=value`` or names an unknown key."""
    keys, open_maps = _valid_keys(defaults)
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"arguments are key=value pairs, got {arg!r}")
        key = arg.split("=", 1)[0].lstrip("+")
        if key in keys or any(key.startswith(m + ".") for m in open_maps):
            continue
        if MOVED_KEYS.get(key) in keys:
            raise ConfigError(f"{key}: moved to {MOVED_KEYS[key]}")
        raise ConfigError(f"unknown key {key!r}" + closest_hint(key, keys, cutoff=0.5))


def closest_hint(name: str, choices: Iterable[str], *, otherwise: str = "", cutoff: float = 0.6) -> str:
    """``"; did you mean 'x'?"`` naming the choice closest to ``name`` (:func:`difflib.get_close_matches`
    with ``cutoff``), else ``otherwise``: the tail of every "unknown ..." error message."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else otherwise


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, Mapping) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def load_config(defaults: str | Path | Mapping[str, Any], argv: list[str]) -> DictConfig:
    """Defaults (YAML path or mapping), then an optional ``config=<recipe>``, then ``argv`` overrides.

    Raises:
        ConfigError: unknown key, malformed argument, or a recipe that does not exist.
    """
    base = OmegaConf.load(defaults) if isinstance(defaults, (str, Path)) else OmegaConf.create(dict(defaults))
    plain = OmegaConf.to_container(base, resolve=False)
    recipes = [a.split("=", 1)[1] for a in argv if a.startswith("config=")]
    argv = [a for a in argv if not a.startswith("config=")]
    for name in recipes:
        path = Path(name)
        if not path.exists() and isinstance(defaults, (str, Path)):
            path = Path(defaults).parent / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if not path.exists():
            known = recipes_of(defaults) if isinstance(defaults, (str, Path)) else []
            raise ConfigError(f"config={name}: no such recipe file" + (f"; recipes here: {known}" if known else ""))
        recipe = OmegaConf.load(path)
        try:
            check_overrides(plain, [f"{k}=" for k in _leaves(OmegaConf.to_container(recipe, resolve=False))])
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        base = OmegaConf.merge(base, recipe)
    check_overrides(plain, argv)
    for argument in argv:
        try:
            OmegaConf.from_dotlist([argument.lstrip("+")])
        except (yaml.YAMLError, OmegaConfBaseException) as error:
            raise ConfigError(f"{argument}: not a value OmegaConf reads ({one_line(error)})") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist([a.lstrip("+") for a in argv]))
    except (OmegaConfBaseException, TypeError, ValueError) as error:  # e.g. a list for a mapping: name it
        for argument in argv:
            try:
                OmegaConf.merge(base, OmegaConf.from_dotlist([argument.lstrip("+")]))
            except (OmegaConfBaseException, TypeError, ValueError) as own:
                raise ConfigError(f"{argument}: {one_line(own)}") from None
        raise ConfigError(one_line(error)) from None
    check_types(plain, OmegaConf.to_container(merged, resolve=False))
    return merged


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message (OmegaConf's and YAML's run over several)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


#: Keys whose number or bool default also takes ``null``, where null means something: off
#: (``critic.value_clip``), or the default (a LoRA setting: :meth:`rl2gem.training.settings.LoraSettings.from_section`).
NULLABLE = ("critic.value_clip", "*.lora.*")

#: What a default's type accepts: a float default takes an int; a bool only a bool. (A string default
#: takes any value: keys like ``max_length: auto`` also take a number.)
_ACCEPTS = {bool: (bool,), int: (int,), float: (int, float)}
_NAMES = {bool: "a bool (true or false)", int: "an int", float: "a float"}


def check_types(defaults: Mapping[str, Any], config: Mapping[str, Any], prefix: str = "") -> None:
    """Raise :class:`ConfigError` ``key: expected a float, got 'abc'`` for a value whose type does
    not fit its default's (a ``null`` default, or an ``${...}`` interpolation, takes anything; a
    number default also takes ``auto``; a number or bool default does not take ``null`` unless the
    key is :data:`NULLABLE`, nor a mapping default a value that is not one)."""
    for key, default in defaults.items():
        if key not in config:
            continue
        value, name = config[key], f"{prefix}{key}"
        if isinstance(default, Mapping) and isinstance(value, Mapping):
            check_types(default, value, name + ".")
            continue
        if isinstance(default, Mapping) and value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a mapping ({name}.KEY=VALUE), got {value!r}")
        if value is None and type(default) in _ACCEPTS and not any(fnmatch.fnmatch(name, k) for k in NULLABLE):
            raise ConfigError(f"{name}: expected {_NAMES[type(default)]}, got null")
        if default is None or value is None or (isinstance(value, str) and value.startswith("${")):
            continue
        if value == "auto" and type(default) in (int, float):  # numeric keys probed at start take ``auto``
            continue
        kind = type(default)
        if kind in _ACCEPTS and (
            not isinstance(value, _ACCEPTS[kind]) or (kind is not bool and isinstance(value, bool))
        ):
            raise ConfigError(f"{name}: expected {_NAMES[kind]}, got {value!r}")


#: The arguments that ask a command line for its keys instead of running it.
HELP_ARGUMENTS = ("--help", "-h", "help=true")


def recipes_of(defaults: str | Path) -> list[str]:
    """The recipes of the command whose YAML ``defaults`` these are: the other YAML files next to
    it whose keys all exist in its defaults, less another command's defaults and a recipe named for
    another command (``guess_sft`` is the ``sft`` command's, ``tune_arithmetic`` the ``tune``
    command's; a command is a ``<name>.py`` in the folder above)."""
    path = Path(defaults)
    plain = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    files = sorted(path.parent.glob("*.yaml"))
    commands = {f.stem for f in files if (path.parent.parent / f"{f.stem}.py").exists()}  # their defaults
    recipes = []
    for recipe in files:
        named = {part for part in (recipe.stem.rpartition("_")[2], recipe.stem.partition("_")[0]) if part in commands}
        if recipe.stem in commands or (named and path.stem not in named):
            continue
        try:
            leaves = _leaves(OmegaConf.to_container(OmegaConf.load(recipe), resolve=False))
            check_overrides(plain, [f"{key}=" for key in leaves])
        except ConfigError:
            continue
        recipes.append(recipe.stem)
    return recipes


def config_help(defaults: str | Path | Mapping[str, Any]) -> str:
    """The help of a command line over the YAML ``defaults``: the usage line, the defaults file as
    written (every key, its default and its comment: the schema) and the recipes next to it that
    ``config=<name>`` merges over the defaults. Defaults given as a mapping: the usage line and
    every key with its default."""
    if not isinstance(defaults, (str, Path)):
        listed = yaml.safe_dump(OmegaConf.to_container(OmegaConf.create(dict(defaults))), sort_keys=False)
        return f"usage: [key=value ...]   (unknown keys and values of the wrong type are errors)\n\nkeys and defaults:\n\n{listed.rstrip()}"
    path = Path(defaults)
    recipes = recipes_of(path)
    return (
        "usage: [config=<recipe>] [key=value ...]   (unknown keys and values of the wrong type are errors)\n\n"
        f"keys, defaults and descriptions ({path.name}):\n\n{path.read_text().rstrip()}\n\n"
        f"recipes (config=<name>): {', '.join(recipes) if recipes else 'none'}"
    )


def config_error_exit_code() -> int:
    """The exit code of a command line whose config :func:`command_line_config` refused: 2 on rank
    0 (the rank that printed why; also without torchrun), 0 on the other ranks. Under torchrun
    every rank finds the same error; had the silent ranks failed too, torchrun would stop rank 0
    as soon as one of them exited, possibly before its line was written. The job still fails,
    with rank 0's code."""
    return 2 if os.environ.get("RANK", "0") == "0" else 0


def command_line_config(
    defaults: str | Path | Mapping[str, Any], check: Callable[[DictConfig], None], argv: list[str] | None = None
) -> DictConfig | None:
    """The config of a command line (:func:`load_config` on ``argv``, default ``sys.argv[1:]``)
    after ``check`` (combinations that cannot work); on a :class:`ConfigError` the message goes to
    stderr as ``config error: ...`` (from rank 0 only: under torchrun every rank checks the same
    config and exits, and one line says why) and the result is None (the command then exits with
    :func:`config_error_exit_code`). ``--help``,
    ``-h`` or ``help=true`` prints :func:`config_help` and exits with 0."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in HELP_ARGUMENTS for arg in argv):
        print(config_help(defaults))
        raise SystemExit(0)
    try:
        cfg = load_config(defaults, argv)
        check(cfg)
    except (ConfigError, OmegaConfBaseException) as e:  # OmegaConf's: an interpolation that does not resolve
        if os.environ.get("RANK", "0") == "0":  # every rank checks and exits; one says why
            key = getattr(e, "full_key", None)
            print(f"config error: {f'{key}: ' if key else ''}{one_line(e)}", file=sys.stderr)
        return None
    return cfg
