"""Rollout engines: one async generate interface (:mod:`.base`), three implementations."""

from rl2gem._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        name: f"rl2gem.rollout.engines.{mod}"
        for name, mod in {
            "Engine": "base",
            "EngineError": "base",
            "GenerateOutput": "base",
            "SamplingParams": "base",
            "EmbeddedEngine": "embedded",
            "HTTPEngine": "http",
            "SGLangEngine": "sglang",
        }.items()
    },
)
