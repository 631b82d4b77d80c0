"""rl2gem: Gymnasium-native agentic text environments for LLMs, and a Ray-less RL trainer.

Importing :mod:`rl2gem` registers the built-in environments under the
Gymnasium namespace ``rl2`` and loads env plugins of other installed packages
(entry-point group ``rl2gem.envs``)::

    import gymnasium as gym
    import rl2gem
    env = gym.make("rl2/GuessTheNumber-v0")
    # or, without importing rl2gem first:
    env = gym.make("rl2gem:rl2/GuessTheNumber-v0")

GPU-only packages (flash-attn, ring-flash-attn, sglang) are imported lazily by
the modules that use them; ``import rl2gem`` needs neither them nor a GPU.
"""

import rl2gem.envs  # noqa: F401  (registers the built-in envs)
from rl2gem.core import MAX_ACTION_CHARS, MAX_OBSERVATION_CHARS, Env, TextSpace, Wrapper
from rl2gem.registry import NAMESPACE, list_envs, load_plugins, make, make_vec, register, standard_kwargs
from rl2gem.vector import AsyncVectorEnv, SyncVectorEnv
from rl2gem.wrappers import ChatHistory

__version__ = "0.1.0"

__all__ = [
    "Env",
    "Wrapper",
    "TextSpace",
    "ChatHistory",
    "AsyncVectorEnv",
    "SyncVectorEnv",
    "register",
    "make",
    "make_vec",
    "list_envs",
    "load_plugins",
    "standard_kwargs",
    "NAMESPACE",
    "MAX_ACTION_CHARS",
    "MAX_OBSERVATION_CHARS",
    "__version__",
]

load_plugins()
