"""Lazy re-exports: a package lists ``name -> module`` and imports the module on first access."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[list[str], Callable[[str], object]]:
    """``(__all__, __getattr__)`` for ``package`` re-exporting ``exports`` lazily (PEP 562)."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(exports), __getattr__
