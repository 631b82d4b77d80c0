"""SGLang servers on GPUs: a launcher plus :class:`HTTPEngine` with tensor weight sync.

:class:`SGLangEngine` is the HTTP client of :mod:`rl2gem.rollout.engines.http`
(request/response handling is shared with the embedded server, so the CPU
tests cover it) plus:

* :meth:`SGLangEngine.launch`: starts ``python -m sglang.launch_server``
  processes (one per GPU group, ``--base-gpu-id``), waits for ``/health``,
  and optionally puts the real ``sglang-router`` in front of them;
* weight updates with ``update_weights_from_tensor`` when the trainer's tensors
  are on a CUDA device on the same machine (CUDA IPC handles, serialised with
  SGLang's own ``MultiprocessingSerializer``), and from disk otherwise.

``sglang`` is imported only inside these methods (``pip install rl2gem[gpu]``);
``import rl2gem`` never needs it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from typing import Any

from rl2gem.procs import ServiceProcess
from rl2gem.rollout.engines.base import EngineError
from rl2gem.rollout.engines.http import HTTPEngine

__all__ = ["SGLangEngine", "sglang_server_command"]


def sglang_server_command(
    model_path: str,
    port: int,
    *,
    base_gpu_id: int = 0,
    tp_size: int = 1,
    mem_fraction: float = 0.6,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The ``sglang.launch_server`` command line for one server on 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-gpu-id",
        str(base_gpu_id),
        "--tp-size",
        str(tp_size),
        "--mem-fraction-static",
        str(mem_fraction),
        "--skip-server-warmup",
        *(extra_args or []),
    ]


class SGLangEngine(HTTPEngine):
    """Client of SGLang servers (optionally launched and routed by this object).

    Args:
        url / workers / timeout / retries: as :class:`HTTPEngine`.
        tp_size: tensor-parallel size of each server (one serialised payload per TP rank).
    """

    def __init__(self, url: str, workers: list[str] | None = None, *, tp_size: int = 1, **kw):
        super().__init__(url, workers, **kw)
        self.tp_size = tp_size
        self._procs: list[ServiceProcess] = []
        self._router = None

    @classmethod
    def launch(
        cls,
        model_path: str,
        *,
        num_servers: int = 1,
        tp_size: int = 1,
        router_policy: str | None = "cache_aware",
        mem_fraction: float = 0.6,
        extra_args: list[str] | None = None,
        startup_timeout: float = 900.0,
    ) -> SGLangEngine:
        """Start ``num_servers`` SGLang servers on GPUs ``[i * tp_size, (i + 1) * tp_size)``.

        Raises:
            ImportError: sglang is not installed (``pip install rl2gem[gpu]``).
            RuntimeError: a server did not become healthy.
        """
        try:
            import sglang  # noqa: F401
        except ImportError as e:
            raise ImportError("SGLangEngine.launch needs sglang: pip install 'rl2gem[gpu]'") from e
        from rl2gem.procs import free_port
        from rl2gem.rollout.router import Router

        procs = []
        try:
            for i in range(num_servers):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = sglang_server_command(
                    model_path,
                    port,
                    base_gpu_id=i * tp_size,
                    tp_size=tp_size,
                    mem_fraction=mem_fraction,
                    extra_args=extra_args,
                )
                procs.append(ServiceProcess(cmd, url=url, health_path="/health", timeout=startup_timeout))
            workers = [p.url for p in procs]
            router = Router(workers, policy=router_policy) if router_policy and num_servers > 1 else None
        except BaseException:
            for p in procs:
                p.stop()
            raise
        eng = cls(router.url if router else workers[0], workers, tp_size=tp_size)
        eng._procs, eng._router = procs, router
        return eng

    async def update_weights(self, weights, version: int | None = None) -> int:
        """CUDA tensors -> ``/update_weights_from_tensor`` (IPC handles); anything else -> disk."""
        if not isinstance(weights, (str, bytes, Mapping)):
            weights = list(weights)
        if isinstance(weights, (str, bytes)) or not _all_cuda(weights):
            return await super().update_weights(weights, version)
        from sglang.srt.utils import MultiprocessingSerializer  # lazy: GPU-only path

        new_version = self.weight_version + 1 if version is None else int(version)
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        named = [(k, v.detach().contiguous()) for k, v in items]
        payload = MultiprocessingSerializer.serialize(named, output_str=True)
        body = {
            "serialized_named_tensors": [payload] * self.tp_size,
            "flush_cache": True,
            "weight_version": str(new_version),
        }
        res = await self._all("POST", "/update_weights_from_tensor", body)
        bad = [r for r in res if isinstance(r, dict) and not r.get("success", True)]
        if bad:
            raise EngineError(f"update_weights_from_tensor failed: {bad[0].get('message')}")
        self.weight_version = new_version
        return new_version

    async def close(self) -> None:
        await super().close()
        if self._router is not None:
            await asyncio.to_thread(self._router.close)
            self._router = None
        for p in self._procs:
            await asyncio.to_thread(p.stop)
        self._procs = []


def _all_cuda(weights: Any) -> bool:
    try:
        items = weights.values() if isinstance(weights, Mapping) else [v for _, v in weights]
        items = list(items)
        return bool(items) and all(getattr(v, "is_cuda", False) for v in items)
    except TypeError:
        return False
