"""Episodes per second: rl2gem's vector envs against GEM's, side by side in one run.

Both libraries run the *same task logic* (guess a number in 1..50, 7 turns,
random guesses) through a thin adapter each, so the difference measured is the
env/vector machinery:

* ``compute``: the task alone (a compute-only env).
* ``io``: every step first waits ``--latency`` seconds times a factor drawn
  uniformly from ``[1 - jitter, 1 + jitter]`` (seeded per env, the same draws
  on both sides), like a search or tool call. GEM has no async env API, so its
  adapter blocks (``time.sleep``) and GEM's ``async_mode`` thread pool overlaps
  the waits; rl2gem's adapter awaits (``asyncio.sleep``) in ``_astep``.

Columns: GEM ``make_vec`` with ``async_mode=True`` (thread pool, SAME_STEP
autoreset; the reference the ratios use) and sync; rl2gem ``AsyncVectorEnv``
driven three ways: *lock-step* (``await astep(all actions)``, like GEM's step)
with NEXT_STEP autoreset (the default, which spends one step per episode on
the reset) and with SAME_STEP (GEM's mode: the like-for-like comparison), and
*free-running* (one coroutine per env calling ``await astep({i: action})``, the
subset stepping a multi-turn rollout uses: no env waits for the slowest one);
and ``SyncVectorEnv``. Each cell runs for ``--duration`` seconds of wall time,
counting finished episodes.

Run: ``python benchmarks/env_throughput.py`` (``--quick`` for a smoke run).
Needs ``gem-llm`` (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import time

import numpy as np

import rl2gem
from rl2gem import AsyncVectorEnv, SyncVectorEnv

LO, HI, TURNS = 1, 50, 7
#: Seed of the random guesses; distinct from the env seeds (0..n-1), so the
#: guess stream never replays a target stream.
ACTION_SEED = 987_654_321


class GuessTask:
    """The shared task logic: plain Python, no library code.

    Targets come from the task's own RNG, seeded by the env index, so env ``i``
    plays the same sequence of episodes on both sides (with the same guesses).
    """

    def __init__(self, index: int):
        self.rng = np.random.default_rng(20_000 + index)

    def new(self) -> str:
        self.target = int(self.rng.integers(LO, HI + 1))
        self.turn = 0
        return f"Guess my number between {LO} and {HI} in {TURNS} turns; answer \\boxed{{N}}."

    def act(self, action: str) -> tuple[str, float, bool, bool]:
        self.turn += 1
        try:
            guess = int(action[action.rindex("{") + 1 : action.rindex("}")])
        except ValueError:
            return "Answer with \\boxed{N}.", 0.0, False, self.turn >= TURNS
        if guess == self.target:
            return "Correct.", 1.0, True, False
        hint = "higher" if self.target > guess else "lower"
        return f"The number is {hint} than {guess}.", 0.0, False, self.turn >= TURNS


def random_action(rng: np.random.Generator) -> str:
    return f"\\boxed{{{int(rng.integers(LO, HI + 1))}}}"


def action_rngs(n: int) -> list[np.random.Generator]:
    """One guess stream per env, drawn from only when the env really steps."""
    return [np.random.default_rng(ACTION_SEED + i) for i in range(n)]


# ---------------------------------------------------------------- rl2gem side
class Rl2Guess(rl2gem.Env):
    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.task = GuessTask(index)

    def _reset(self, options):
        return self.task.new(), {}

    def _step(self, action):
        obs, r, term, trunc = self.task.act(action)
        return obs, r, term, trunc, {}


class Latency:
    """Per-env latency draws: ``latency * U(1 - jitter, 1 + jitter)``, seeded by the env index."""

    def __init__(self, latency: float, jitter: float, index: int):
        self.latency, self.jitter = latency, jitter
        self.rng = np.random.default_rng(10_000 + index)

    def __call__(self) -> float:
        return self.latency * float(self.rng.uniform(1 - self.jitter, 1 + self.jitter))


class Rl2GuessIO(rl2gem.Env):
    def __init__(self, latency: Latency, index: int, **kwargs):
        super().__init__(**kwargs)
        self.task = GuessTask(index)
        self.latency = latency

    async def _areset(self, options):
        return self.task.new(), {}

    async def _astep(self, action):
        await asyncio.sleep(self.latency())
        obs, r, term, trunc = self.task.act(action)
        return obs, r, term, trunc, {}


def rl2_envs(n: int, latency: float, jitter: float):
    if latency > 0:
        return [lambda i=i: Rl2GuessIO(Latency(latency, jitter, i), i) for i in range(n)]
    return [lambda i=i: Rl2Guess(i) for i in range(n)]


def run_rl2_async(n: int, latency: float, jitter: float, duration: float, mode: str = "NextStep") -> float:
    """Lock-step: every call steps all envs and waits for the slowest."""
    same_step = mode == "SameStep"

    async def main() -> float:
        venv = AsyncVectorEnv(rl2_envs(n, latency, jitter), autoreset_mode=mode)
        rngs, done = action_rngs(n), np.zeros(n, dtype=bool)
        await venv.areset(seed=0)
        episodes, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            # NEXT_STEP: an env that finished last step is reset by this one; its action is unused
            actions = ["" if done[i] and not same_step else random_action(rngs[i]) for i in range(n)]
            _, _, term, trunc, _ = await venv.astep(actions)
            done = term | trunc
            episodes += int(np.count_nonzero(done))
        rate = episodes / (time.perf_counter() - t0)
        await venv.aclose()
        return rate

    return asyncio.run(main())


def run_rl2_free(n: int, latency: float, jitter: float, duration: float) -> float:
    """Free-running: one coroutine per env steps its own slot as soon as its last step returned."""

    async def main() -> float:
        venv = AsyncVectorEnv(rl2_envs(n, latency, jitter))
        await venv.areset(seed=0)
        episodes, t0 = 0, time.perf_counter()

        async def worker(i: int) -> None:
            nonlocal episodes
            rng, done = action_rngs(n)[i], False
            while time.perf_counter() - t0 < duration:
                _, _, term, trunc, _ = await venv.astep({i: "" if done else random_action(rng)})
                done = bool(term[0] or trunc[0])
                episodes += done

        await asyncio.gather(*(worker(i) for i in range(n)))
        rate = episodes / (time.perf_counter() - t0)
        await venv.aclose()
        return rate

    return asyncio.run(main())


def run_rl2_sync(n: int, latency: float, jitter: float, duration: float) -> float:
    venv = SyncVectorEnv(rl2_envs(n, latency, jitter))
    rngs, done = action_rngs(n), np.zeros(n, dtype=bool)
    venv.reset(seed=0)
    episodes, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        _, _, term, trunc, _ = venv.step(["" if done[i] else random_action(rngs[i]) for i in range(n)])
        done = term | trunc
        episodes += int(np.count_nonzero(done))
    rate = episodes / (time.perf_counter() - t0)
    venv.close()
    return rate


# ------------------------------------------------------------------- GEM side
def run_gem(n: int, latency: float, jitter: float, duration: float, async_mode: bool) -> float:
    with contextlib.redirect_stdout(io.StringIO()):
        import gem
    logging.getLogger().setLevel(logging.WARNING)

    class GemGuess(gem.Env):
        def __init__(self, seed: int | None = None, **kwargs):
            super().__init__()
            self.task = GuessTask(seed or 0)  # make_vec passes seed = index
            self.latency = Latency(latency, jitter, seed or 0)

        def reset(self, seed: int | None = None):
            return self.task.new(), {}

        def step(self, action):
            if latency > 0:
                time.sleep(self.latency())
            obs, r, term, trunc = self.task.act(action)
            return obs, r, term, trunc, {}

    env_id = f"bench:Guess-{'io' if latency else 'cpu'}-v0"
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        gem.register(env_id, GemGuess)
    with contextlib.redirect_stdout(io.StringIO()):
        venv = gem.make_vec([env_id] * n, async_mode=async_mode, seed=0)
    rngs = action_rngs(n)
    venv.reset(seed=0)
    episodes, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:  # SAME_STEP: every env steps every time
        _, _, term, trunc, _ = venv.step([random_action(rngs[i]) for i in range(n)])
        episodes += int(np.count_nonzero(np.asarray(term) | np.asarray(trunc)))
    rate = episodes / (time.perf_counter() - t0)
    if async_mode:
        venv.thread_pool_executer.shutdown(wait=True)
    return rate


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--latency", type=float, default=0.05, help="mean seconds per step in the io env")
    p.add_argument("--jitter", type=float, default=0.5, help="latency factor drawn from U(1-j, 1+j)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of wall time per cell")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.5 s per cell, 1 and 8 envs, 10 ms latency")
    args = p.parse_args(argv)
    if args.quick:
        args.envs, args.duration, args.latency = [1, 8], 0.5, 0.01

    rows = []
    for kind, latency in (("compute", 0.0), (f"io {args.latency * 1000:.0f}ms", args.latency)):
        for n in args.envs:
            cell = (n, latency, args.jitter, args.duration)
            row = {
                "env": kind,
                "envs": n,
                "gem_async": run_gem(*cell, async_mode=True),
                "gem_sync": run_gem(*cell, async_mode=False),
                "rl2_lock": run_rl2_async(*cell),
                "rl2_lock_same": run_rl2_async(*cell, mode="SameStep"),
                "rl2_free": run_rl2_free(*cell),
                "rl2_sync": run_rl2_sync(*cell),
            }
            rows.append(row)
            print(f"  measured {kind} x{n}", flush=True)

    print(
        f"\nEpisodes per second (random guesses, same task logic, {args.duration:.1f} s per cell, "
        f"io latency {args.latency * 1000:.0f} ms +-{args.jitter * 100:.0f}%)\n"
    )
    print(
        "| env | envs | GEM async | GEM sync | rl2gem lock-step NEXT_STEP | rl2gem lock-step SAME_STEP "
        "| rl2gem free-running | rl2gem sync | SAME_STEP lock-step / GEM async | free-running / GEM async |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def f(x: float) -> str:
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    for r in rows:
        ref = max(r["gem_async"], 1e-9)
        print(
            f"| {r['env']} | {r['envs']} | {f(r['gem_async'])} | {f(r['gem_sync'])} | {f(r['rl2_lock'])} | "
            f"{f(r['rl2_lock_same'])} | {f(r['rl2_free'])} | {f(r['rl2_sync'])} | "
            f"{r['rl2_lock_same'] / ref:.2f}x | {r['rl2_free'] / ref:.2f}x |"
        )
    return rows


if __name__ == "__main__":
    main()
