"""Load balancing over engine servers with the real ``sglang-router``.

:class:`Router` starts ``python -m sglang_router.launch_router`` (a Rust
binary from PyPI that runs on CPU) on a loopback port in front of N servers
that speak SGLang's API (``python -m rl2gem.serve`` or SGLang itself).
``POST /generate`` goes through the router; pause / continue / weight updates
must go to every worker directly, because the router does not forward them
(:class:`~rl2gem.rollout.engines.http.HTTPEngine` does that given
``workers=router.workers``).

Failover, as launched here: health checks every ``health_check_interval``
seconds with a failure threshold of 1 take a dead worker out of rotation
within about a second, and the router retries a failed or refused request
on another worker (``retries`` attempts, backoff 0.1-0.5 s). The circuit
breaker is off: it also counts 4xx answers and would eject a worker for a
minute over a client's bad requests. A worker that comes back on the same
URL rejoins after one healthy check.

Policies: ``cache_aware`` (default: requests sharing a prefix go to the same
worker, balanced when loads diverge), ``round_robin`` (even spread),
``power_of_two`` (least loaded of two, by ``/get_load``), ``random``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

from rl2gem.procs import ServiceProcess, free_port

__all__ = ["Router", "POLICIES"]

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def _get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class Router:
    """An ``sglang-router`` process in front of ``workers``.

    Args:
        workers: engine server URLs (already answering ``/health``).
        policy: one of :data:`POLICIES`.
        port: router port (0: a free one).
        health_check_interval: seconds between health checks.
        retries: attempts per request across workers.
        startup_timeout: seconds to wait for every worker to be healthy.
        extra_args: more ``launch_router`` flags.

    Raises:
        ValueError: unknown policy or no workers.
        ImportError: ``sglang-router`` is not installed.
        RuntimeError: the router did not start or the workers are not healthy in time.
    """

    def __init__(
        self,
        workers: list[str],
        *,
        policy: str = "cache_aware",
        port: int = 0,
        health_check_interval: int = 1,
        retries: int = 6,
        startup_timeout: float = 60.0,
        extra_args: list[str] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose from {POLICIES}")
        if not workers:
            raise ValueError("a router needs at least one worker URL")
        try:
            import sglang_router  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "the router needs the sglang-router package: pip install 'sglang-router>=0.3.2,<0.4'"
            ) from e
        self.workers = [w.rstrip("/") for w in workers]
        self.policy = policy
        last: Exception | None = None
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                *self.workers,
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--health-check-interval-secs",
                str(int(health_check_interval)),
                "--health-check-timeout-secs",
                "1",
                "--health-failure-threshold",
                "1",
                "--health-success-threshold",
                "1",
                "--retry-max-retries",
                str(int(retries)),
                "--retry-initial-backoff-ms",
                "100",
                "--retry-max-backoff-ms",
                "500",
                "--disable-circuit-breaker",
                "--worker-startup-timeout-secs",
                str(int(max(startup_timeout, 10))),
                "--log-level",
                "warn",
                *(extra_args or []),
            ]
            try:
                self._proc = ServiceProcess(
                    cmd, url=self.url, health_path="/health", timeout=30, env={"RUST_LOG": "warn"}
                )
                break
            except RuntimeError as e:
                last = e
                if port:
                    raise
        else:
            raise RuntimeError(f"sglang-router did not start: {last}")
        self.wait_healthy(len(self.workers), timeout=startup_timeout)

    def readiness(self) -> dict:
        """The router's ``/readiness`` answer (``healthy_workers``, ``total_workers``)."""
        try:
            return _get_json(self.url + "/readiness")
        except urllib.error.HTTPError as e:  # 503 while no worker is healthy
            return json.loads(e.read().decode() or "{}")

    def wait_healthy(self, n: int, timeout: float = 60.0) -> None:
        """Block until ``n`` workers are healthy.

        Raises:
            RuntimeError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        state: dict = {}
        while time.monotonic() < deadline:
            if not self._proc.alive:
                break
            try:
                state = self.readiness()
                if state.get("healthy_workers", 0) >= n:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"sglang-router: {n} healthy workers expected, got {state}; log:\n" + "\n".join(self._proc.output)
        )

    def list_workers(self) -> list[dict]:
        """The router's view of its workers (URL, health, load)."""
        body = _get_json(self.url + "/workers")
        return body.get("workers", body) if isinstance(body, dict) else body

    def add_worker(self, url: str) -> None:
        """Register one more worker at run time."""
        req = urllib.request.Request(
            self.url + "/workers",
            data=json.dumps({"url": url}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).close()
        self.workers.append(url.rstrip("/"))

    @property
    def alive(self) -> bool:
        return self._proc.alive

    def close(self) -> None:
        """Stop the router (SIGTERM, then SIGKILL)."""
        self._proc.stop(timeout=6)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
