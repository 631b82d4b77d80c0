"""Rollout: engines, token-in/token-out multi-turn episodes, router, partial rollouts.

Heavy modules (torch, transformers, aiohttp) are imported on first use of a name.
"""

from rl2gem._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "Engine": "rl2gem.rollout.engines.base",
        "EngineError": "rl2gem.rollout.engines.base",
        "GenerateOutput": "rl2gem.rollout.engines.base",
        "SamplingParams": "rl2gem.rollout.engines.base",
        "EmbeddedEngine": "rl2gem.rollout.engines.embedded",
        "HTTPEngine": "rl2gem.rollout.engines.http",
        "SGLangEngine": "rl2gem.rollout.engines.sglang",
        "Router": "rl2gem.rollout.router",
        "ChatRenderer": "rl2gem.rollout.tito",
        "Episode": "rl2gem.rollout.tito",
        "Sequence": "rl2gem.rollout.tito",
        "EnvError": "rl2gem.rollout.rollout",
        "Rollout": "rl2gem.rollout.rollout",
        "RolloutBatch": "rl2gem.rollout.rollout",
        "RolloutConfig": "rl2gem.rollout.rollout",
        "merge_rank_metrics": "rl2gem.rollout.rollout",
        "reward_metrics": "rl2gem.rollout.rollout",
    },
)
