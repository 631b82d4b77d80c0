"""Steps per second of a served env (``python -m rl2gem.envserver``) against the same env in process.

The same env (``--env``, default ``rl2/GuessTheNumber-v0``: pure compute, so what is measured is
the serving path: HTTP, JSON, sessions) is played by ``N`` concurrent episodes, ``N`` in
``--sessions`` (1, 8, 64), each a coroutine that resets and then steps with random guesses until
its episode ends, for ``--duration`` seconds:

* ``in process``: ``rl2gem.make(env)`` per episode, ``await env.areset`` / ``env.astep`` (a
  compute-only env's calls run in worker threads);
* ``served``: ``rl2/Remote-v0`` clients (one session each) of an env server started here as a
  child process on a loopback port (the server's loop and the clients' loop on different cores).

Printed: steps/s of each and the ratio served / in process, per ``N``. OpenEnv's own server is not
run here: ``openenv-core`` 0.3.0 installs (it pulls FastAPI, uvicorn, fastmcp and gradio), but its
server needs an OpenEnv ``Environment`` class and pydantic action/observation models per env, so
the same env logic would need a port of the env first.

Run: ``python benchmarks/env_server.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np

import rl2gem
from rl2gem.envserver import READY_PREFIX


async def _episodes(make, sessions: int, duration: float) -> int:
    """Steps taken by ``sessions`` concurrent episode loops (random guesses) in ``duration`` seconds."""
    deadline = time.monotonic() + duration
    steps = [0] * sessions

    async def loop(k: int) -> None:
        env, rng = make(), np.random.default_rng(k)
        seed = k * 1000
        try:
            while time.monotonic() < deadline:
                await env.areset(seed=seed)
                seed += 1
                done = False
                while not done and time.monotonic() < deadline:
                    *_, terminated, truncated, _ = await env.astep(f"\\boxed{{{int(rng.integers(1, 101))}}}")
                    steps[k] += 1
                    done = terminated or truncated
        finally:
            await env.aclose()

    await asyncio.gather(*(loop(k) for k in range(sessions)))
    return sum(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="rl2/GuessTheNumber-v0")
    parser.add_argument("--sessions", default="1,8,64")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--quick", action="store_true", help="1 s per cell")
    args = parser.parse_args()
    duration = 1.0 if args.quick else args.duration
    server = subprocess.Popen(
        [sys.executable, "-m", "rl2gem.envserver", args.env, "--port", "0", "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        if not line.startswith(READY_PREFIX):
            raise SystemExit(f"the env server did not start: {line!r}")
        url = line.split()[-1]
        rows = []
        for sessions in (int(n) for n in args.sessions.split(",")):
            local = asyncio.run(_episodes(lambda: rl2gem.make(args.env), sessions, duration))
            served = asyncio.run(_episodes(lambda: rl2gem.make("rl2/Remote-v0", url=url), sessions, duration))
            rows.append((sessions, local / duration, served / duration))
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    print(f"\n{args.env}, random guesses, {duration:g} s per cell\n")
    print("| concurrent episodes | in process, steps/s | served (rl2/Remote-v0), steps/s | served / in process |")
    print("|---:|---:|---:|---:|")
    for sessions, local, served in rows:
        print(f"| {sessions} | {local:.0f} | {served:.0f} | {served / local:.2f}x |")


if __name__ == "__main__":
    main()
