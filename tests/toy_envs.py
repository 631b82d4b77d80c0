"""Small envs used by the tests (not registered globally)."""

from __future__ import annotations

import asyncio
import random
import threading

from rl2gem import Env


class CountEnv(Env):
    """Compute-only: the agent must say the next number; the target count comes from the seed."""

    def __init__(self, max_turns: int | None = 10, **kwargs):
        super().__init__(max_turns=max_turns, **kwargs)
        self.step_threads: set[int] = set()

    def _reset(self, options):
        self.goal = int(self.np_random.integers(3, 6))
        self.n = 0
        return f"Count to {self.goal}, one number per turn.", {"goal": self.goal}

    def _step(self, action):
        self.step_threads.add(threading.get_ident())
        if not action.strip().isdigit():
            return self.invalid_action("not a number", "Say a number.")
        if int(action) != self.n + 1:
            return f"Wrong, say {self.n + 1}.", 0.0, False, False, {}
        self.n += 1
        done = self.n == self.goal
        return ("Done." if done else "Next."), (1.0 if done else 0.0), done, False, {}

    def sample_random_action(self, rng=None):
        rng = rng if rng is not None else self.np_random
        return str(int(rng.integers(1, 6)))


class SlowResetEnv(CountEnv):
    """A CountEnv whose reset waits ``reset_latency`` seconds on a 'service'; counts its resets."""

    resets = 0

    def __init__(self, reset_latency: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.reset_latency = reset_latency

    async def _areset(self, options):
        type(self).resets += 1
        await asyncio.sleep(self.reset_latency)
        return self._reset(options)

    async def _astep(self, action):
        return self._step(action)


class SlowSearchEnv(Env):
    """Async-native: each step 'calls a service' (an asyncio sleep) and replies as a tool."""

    in_flight = 0
    max_in_flight = 0

    def __init__(self, latency: float = 0.01, **kwargs):
        super().__init__(max_turns=kwargs.pop("max_turns", 4), **kwargs)
        self.latency = latency
        self.closed_async = 0

    async def _areset(self, options):
        await asyncio.sleep(0)
        self.secret = int(self.np_random.integers(0, 100))
        return "Find the secret with <search>q</search>, answer with <answer>n</answer>.", {}

    async def _astep(self, action):
        cls = type(self)
        cls.in_flight += 1
        cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            await asyncio.sleep(self.latency)
        finally:
            cls.in_flight -= 1
        if action.startswith("<answer>"):
            ok = action == f"<answer>{self.secret}</answer>"
            return "", float(ok), True, False, {}
        if action.startswith("<search>"):
            return f"<information>the secret is {self.secret}</information>", 0.0, False, False, {"role": "tool"}
        return self.invalid_action("missing <search> or <answer> tag")

    async def _aclose(self):
        self.closed_async += 1


class FlakyEnv(Env):
    """Raises from step when told to ('boom'), otherwise echoes."""

    def _reset(self, options):
        return "Say anything; 'boom' crashes me.", {}

    def _step(self, action):
        if action == "boom":
            raise RuntimeError("env exploded")
        return f"echo {action}", 0.0, action == "stop", False, {}


class EvenSeedCrashEnv(Env):
    """One turn, reward 1; the step of an episode whose seed is even raises ``ValueError``."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=1, **kwargs)

    def _reset(self, options):
        return "Say anything.", {}

    def _step(self, action):
        if self._episode_seed % 2 == 0:
            raise ValueError("a bug on even seeds")
        return "Done.", 1.0, True, False, {}


class SeedParityEnv(Env):
    """One turn; reward 1 when the episode seed is even, whatever the action (an invalid one too),
    so the samples of a group (one seed) all score alike and dynamic filtering drops every group."""

    def _reset(self, options):
        return "Say anything.", {}

    def _step(self, action):
        return "Done.", float(self.np_random_seed % 2 == 0), True, False, {}

    def _rejected(self, reason):  # a random model's empty action ends the episode the same way
        return self._step("")


class UnicodeEchoEnv(Env):
    """Echoes each action with its turn and characters beyond ASCII (accents, CJK, an emoji)."""

    def _reset(self, options):
        return f"Échos {int(self.np_random.integers(100))} 数学 🙂\n", {}

    def _step(self, action):
        return f"{self.turn}: «{action}» 🙂", 0.0, self.turn >= 3, False, {}


class GlobalRandomEnv(CountEnv):
    """Broken on purpose: draws its task from the global RNG, ignoring the seed."""

    def _reset(self, options):
        obs, info = super()._reset(options)
        self.goal = random.randint(3, 1000)
        return f"Count to {self.goal}.", info


def even_token_reward(reward, components, episode) -> float:
    """A ``reward.transform`` for random tiny models, which never earn an env's reward: the share of
    the episode's action tokens with an even id, so samples of one group get different rewards."""
    actions = [t for s in episode.sequences for t, m in zip(s.input_ids, s.action_mask, strict=True) if m]
    return sum(t % 2 == 0 for t in actions) / max(len(actions), 1)
