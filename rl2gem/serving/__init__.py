"""The HTTP server: the embedded engine (or an upstream SGLang-API server) behind SGLang's native
API (:mod:`~rl2gem.serving.server`: :class:`NativeRoutes`, :func:`make_app`, :func:`launch`) and
the OpenAI API (:mod:`~rl2gem.serving.openai_routes`: :class:`OpenAIRoutes` and the conversions
between chat messages and tool calls). The command line is ``python -m rl2gem.serve``."""

from rl2gem.serving.openai_routes import OpenAIRoutes, add_openai_routes
from rl2gem.serving.server import READY_PREFIX, NativeRoutes, launch, make_app

__all__ = ["READY_PREFIX", "NativeRoutes", "OpenAIRoutes", "add_openai_routes", "launch", "make_app"]
