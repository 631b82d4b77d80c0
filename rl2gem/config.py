"""``key=value`` configuration over YAML defaults (OmegaConf), with clear errors.

``load_config(defaults, argv)`` merges dot-list overrides (``actor.lr=1e-6``,
``env_kwargs.task=countdown``) over a YAML file or dict. A key that is not in
the defaults is an error naming the closest valid key (``actor.lrr`` -> did you
mean ``actor.lr``?); mappings whose default is empty (``env_kwargs``) accept
any sub-key.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

__all__ = ["ConfigError", "load_config", "check_overrides"]


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


def check_overrides(defaults: Mapping[str, Any], argv: list[str]) -> None:
    """Raise :class:`ConfigError` for an argument that is not ``key=value`` or names an unknown key."""
    keys, open_maps = _valid_keys(defaults)
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"arguments are key=value pairs, got {arg!r}")
        key = arg.split("=", 1)[0].lstrip("+")
        if key in keys or any(key.startswith(m + ".") for m in open_maps):
            continue
        close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.5)
        raise ConfigError(f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))


def load_config(defaults: str | Path | Mapping[str, Any], argv: list[str]) -> DictConfig:
    """Defaults (YAML path or mapping) merged with ``argv`` overrides.

    Raises:
        ConfigError: unknown key or malformed argument.
    """
    base = OmegaConf.load(defaults) if isinstance(defaults, (str, Path)) else OmegaConf.create(dict(defaults))
    plain = OmegaConf.to_container(base, resolve=False)
    check_overrides(plain, argv)
    return OmegaConf.merge(base, OmegaConf.from_dotlist([a.lstrip("+") for a in argv]))
