"""Advantage estimators over token-level batches.

Every estimator takes per-token tensors of one batch of sequences:

* ``rewards``: float32 ``[B, T]``, the reward of each turn on the last token
  of its action (what :class:`rl2gem.rollout.tito.Sequence` records), 0 elsewhere;
* ``action_mask``: ``[B, T]`` (bool or 0/1), 1 on tokens the policy generated;
* ``group``: int64 ``[B]``, sequences with the same id were sampled from the
  same initial state (a GRPO group);

and returns float32 advantages ``[B, T]``, zero outside the action mask, on the inputs' device
(all inputs on one device; ``tests/algorithms/test_devices.py``, ``pytest -m gpu`` on CUDA).
Env tokens (prompt, env replies) never get an advantage; in multi-turn
sequences the estimators that look ahead (returns-to-go, GAE and the other
critic estimators) step from one action token to the next action token,
skipping env tokens, so an episode is one MDP over its action tokens.

Critic estimators (:data:`CRITIC_ESTIMATORS`) also take the critic's values
``[B, T]``; the off-policy ones (:data:`OFF_POLICY_ESTIMATORS`) take per-token
``log_ratio = log pi - log mu`` ``[B, T]``, the policy being trained against
the behaviour policy that sampled each token (the rollout engine's log-probs,
so tokens of a partial rollout sampled by older policy versions are each
corrected by their own ratio). They return ``(advantages, returns)``, the
returns being the critic's targets.

Raises ``ValueError`` on mismatched shapes.
"""

from __future__ import annotations

import torch

from rl2gem.config import closest_hint

__all__ = [
    "BOOTSTRAP_METHODS",
    "CRITIC_ESTIMATORS",
    "ESTIMATORS",
    "action_turns",
    "OFF_POLICY_ESTIMATORS",
    "WEIGHTED_ESTIMATORS",
    "clipped_is",
    "compute_advantages",
    "drgrpo",
    "gae",
    "grpo",
    "multistep",
    "rebn",
    "reinforce_pp",
    "retrace",
    "returns_to_go",
    "rloo",
    "td_lambda",
    "turn_rloo",
    "vtrace",
]


def _check(rewards: torch.Tensor, action_mask: torch.Tensor, group: torch.Tensor | None = None):
    if rewards.dim() != 2 or rewards.shape != action_mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and action_mask {tuple(action_mask.shape)} must both be [B, T]"
        )
    if group is not None and group.shape != (rewards.shape[0],):
        raise ValueError(f"group must be [B] = [{rewards.shape[0]}], got {tuple(group.shape)}")
    return rewards.float(), action_mask.bool()


def _group_stats(scores: torch.Tensor, group: torch.Tensor):
    """Per-sequence ``(score - group mean, group mean, unbiased group std, group size)`` of ``scores`` [B].

    The statistics are taken relative to each group's first member, so a group of equal scores
    gets deviations and a std of exactly 0 (a float32 mean of 16 scores of 7.3 is off by one
    rounding step, and dividing that by an equally tiny std gave every member about -0.48).
    """
    _, inv, counts = torch.unique(group, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    rows = torch.arange(scores.shape[0], device=scores.device)
    first = torch.zeros_like(counts).scatter_reduce_(0, inv, rows, "amin", include_self=False)
    shifted = scores - scores[first][inv]
    shift_mean = torch.zeros_like(n).index_add_(0, inv, shifted) / n
    centered = shifted - shift_mean[inv]
    dev = torch.zeros_like(n).index_add_(0, inv, centered**2)
    std = torch.sqrt(dev / (n - 1).clamp(min=1))
    return centered, scores[first][inv] + shift_mean[inv], std[inv], n[inv]


def _broadcast(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return score[:, None] * mask.float()


def grpo(rewards, action_mask, group, eps: float = 1e-6):
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(R - mean_group) / (std_group + eps)`` on every action token.

    ``R`` is the sequence's total reward; std is the unbiased group std.
    """
    r, m = _check(rewards, action_mask, group)
    centered, _, std, _ = _group_stats(r.sum(-1), group)
    return _broadcast(centered / (std + eps), m)


def drgrpo(rewards, action_mask, group):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``R - mean_group``, no std division
    (pair it with a constant loss normaliser, ``loss_agg="seq_mean_token_sum_norm"``)."""
    r, m = _check(rewards, action_mask, group)
    centered, _, _, _ = _group_stats(r.sum(-1), group)
    return _broadcast(centered, m)


def rloo(rewards, action_mask, group):
    """RLOO (Ahmadian et al. 2024): ``R_i - mean_{j != i} R_j`` = ``n / (n - 1) * (R_i - mean_group)``.

    A group of one gets advantage 0.
    """
    r, m = _check(rewards, action_mask, group)
    centered, _, _, n = _group_stats(r.sum(-1), group)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * centered, torch.zeros_like(centered))
    return _broadcast(adv, m)


def returns_to_go(rewards, action_mask, gamma: float = 1.0):
    """Discounted sum of future rewards at each action token, discounting once per action *token*
    step over action tokens only (env tokens are skipped). ``[B, T]``."""
    r, m = _check(rewards, action_mask)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        mt = m[:, t]
        running = torch.where(mt, r[:, t] + gamma * running, running)
        out[:, t] = torch.where(mt, running, torch.zeros_like(running))
    return out


def _batch_normalize(x: torch.Tensor, m: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` normalised to mean 0 and std 1 over the tokens of ``m`` (taken relative to the first
    such value, so equal values give exactly 0), 0 elsewhere."""
    vals = x[m]
    if vals.numel() < 2:
        return torch.zeros_like(x)
    shifted = vals - vals[0]
    return torch.where(m, (x - vals[0] - shifted.mean()) / (shifted.std() + eps), torch.zeros_like(x))


def reinforce_pp(rewards, action_mask, group=None, gamma: float = 1.0, baseline: bool = True):
    """REINFORCE++ (Hu 2025): token returns-to-go, normalised over all action tokens of the batch.

    With ``baseline`` (REINFORCE++-baseline) the group mean of the sequence reward is subtracted
    from the rewards first (needs ``group``). A per-token KL penalty, when the KL is put in the
    reward, should already be in ``rewards``.
    """
    r, m = _check(rewards, action_mask, group)
    if baseline and group is not None:
        _, mean, _, _ = _group_stats(r.sum(-1), group)
        last = _last_action_token(m)
        r = r.clone()
        rows = torch.arange(r.shape[0], device=r.device)
        has = last >= 0
        r[rows[has], last[has]] -= mean[has]
    return _batch_normalize(returns_to_go(r, m, gamma), m)


def rebn(rewards, action_mask, group=None, gamma: float = 1.0):
    """ReBN, return batch normalisation (GEM, Liu et al. 2025, "GEM: A Gym for Agentic LLMs"):
    per-turn discounted returns (one discount per *turn*, so multi-turn credit does not
    vanish over long actions), normalised over all action tokens of the batch."""
    r, m = _check(rewards, action_mask, group)
    out = torch.zeros_like(r)
    for b, runs in enumerate(action_turns(m)):
        running = 0.0
        for start, end in reversed(runs):  # last turn first
            running = float(r[b, start:end].sum()) + gamma * running
            out[b, start:end] = running
    return _batch_normalize(out, m)


def turn_rloo(turn_rewards, turn_mask, group, gamma: float = 1.0):
    """Per-turn RLOO: each turn's return-to-go minus the leave-one-out group mean of the other
    episodes' returns-to-go at the same turn index, for critic-free credit with per-turn rewards.

    Args:
        turn_rewards: float32 ``[E, K]``, the reward of each turn of each episode (0 past its end).
        turn_mask: bool ``[E, K]``, True on the turns an episode took.
        group: int64 ``[E]``, episodes sampled from the same initial state share an id.
        gamma: discount per turn.

    Returns:
        float32 ``[E, K]`` advantages, 0 past an episode's end and for a group of one; on the
        device of ``turn_rewards``.

    With ``G[i, k] = sum_{k' >= k} gamma^(k' - k) r[i, k']`` (0 after the episode ended, the
    absorbing state), the advantage is ``G[i, k] - mean_{j != i in the group} G[j, k]``. The
    baseline uses only the other episodes, sampled independently from the same initial state, so
    it cannot depend on episode ``i``'s own actions (Williams 1992; Kool et al. 2019 for the
    leave-one-out form) and the policy gradient stays unbiased, even when the policy chooses
    when to stop. The tempting construction, normalising each turn's reward by the group's
    statistics at that turn index and summing the normalised rewards from turn ``k`` on
    (MT-GRPO style), subtracts one more group mean for every turn the episode goes on: a
    baseline set by the episode's own stopping turn, which shifts every "take another turn"
    decision by the group means of the later turns' rewards (verl RFC #7244). No division by the group's
    std (Dr. GRPO: it reweights groups by difficulty); ``tests/algorithms/test_advantages.py``
    checks both claims against the exact gradient of a two-turn decision problem.
    """
    rewards, mask = turn_rewards.float(), turn_mask.bool()
    if rewards.shape != mask.shape or rewards.dim() != 2 or group.shape != rewards.shape[:1]:
        raise ValueError(
            f"turn_rewards {tuple(rewards.shape)}, turn_mask {tuple(mask.shape)}, group {tuple(group.shape)}"
        )
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    following = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for k in range(rewards.shape[1] - 1, -1, -1):
        following = rewards[:, k] + gamma * following
        returns[:, k] = following
    same = group[:, None] == group[None, :]
    others = (same.sum(-1) - 1).to(rewards.dtype)  # episodes in the group besides this one
    group_sums = same.to(rewards.dtype) @ returns  # [E, K]: sum over the episode's group
    baseline = (group_sums - returns) / others.clamp(min=1)[:, None]
    advantages = torch.where(mask & (others[:, None] > 0), returns - baseline, torch.zeros_like(returns))
    return advantages


def action_turns(action_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The turns of each row of ``action_mask`` ``[B, T]``: its runs of action tokens as
    ``(start, end)`` (end exclusive), in order. A turn's reward sits on its last token."""
    turns = []
    for row in action_mask.bool().tolist():
        runs, start = [], None
        for t, on in enumerate([*row, False]):
            if on and start is None:
                start = t
            elif not on and start is not None:
                runs.append((start, t))
                start = None
        turns.append(runs)
    return turns


def _turn_rloo_tokens(rewards, action_mask, group, gamma: float = 1.0, turn_ids=None):
    """:func:`turn_rloo` on token rows (one row = one episode): each action token gets its turn's
    advantage. A turn is a run of action tokens (:func:`action_turns`), or with ``turn_ids``
    (int64 ``[B, T]``, the turn of each action token, -1 elsewhere) the tokens of one id, which
    may span several runs (a managed context's summary and the action after it)."""
    r, m = _check(rewards, action_mask, group)
    if turn_ids is None:
        turn_ids = torch.full(r.shape, -1, dtype=torch.long, device=r.device)
        for b, runs in enumerate(action_turns(m)):
            for k, (start, end) in enumerate(runs):
                turn_ids[b, start:end] = k
    turn_ids = torch.as_tensor(turn_ids, dtype=torch.long, device=r.device)
    turn_ids = torch.where(m, turn_ids, torch.full_like(turn_ids, -1))
    width = int(turn_ids.max().item()) + 1 if turn_ids.numel() else 0
    if width == 0:
        return torch.zeros_like(r)
    taken, slot = turn_ids >= 0, turn_ids.clamp(min=0)
    turn_rewards = torch.zeros(r.shape[0], width, device=r.device).scatter_add_(1, slot, r * taken)
    turn_mask = torch.zeros(r.shape[0], width, device=r.device).scatter_add_(1, slot, taken.float()) > 0
    per_turn = turn_rloo(turn_rewards, turn_mask, group, gamma)
    return torch.where(taken, per_turn.gather(1, slot), torch.zeros_like(r))


def _last_action_token(m: torch.Tensor) -> torch.Tensor:
    """Per row ``[B]``, the index of its last action token, -1 for a row without one."""
    if m.shape[1] == 0:
        return torch.full((m.shape[0],), -1, dtype=torch.long, device=m.device)
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, idx, torch.full_like(idx, -1)).max(-1).values


def gae(rewards, action_mask, values, gamma: float = 1.0, lam: float = 1.0):
    """Generalised Advantage Estimation (Schulman et al. 2016) over action tokens.

    ``values``: float32 ``[B, T]`` critic values. The TD step goes from one action token to the
    next action token of the same sequence (env tokens are skipped, so multi-turn episodes are one
    MDP); after the last action token the next value is 0. That is terminal for an episode cut
    short too (``max_turns``, ``max_length``): there is no state after its last action to value,
    so it is not bootstrapped; an env that should not be learned as ending there is one whose
    budget the policy cannot reach.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``; ``returns = advantages + values`` on action tokens.
    """
    steps = _Steps(rewards, action_mask, values)
    delta = steps.td_errors(gamma)
    advantages = steps.backward(lambda t, following: delta[:, t] + gamma * lam * following)
    return steps.result(advantages, advantages + steps.values)


def _action_steps(action_mask: torch.Tensor):
    """The action tokens of each row, in order: ``(positions [B, N] int64, valid [B, N] bool)`` with
    ``N`` the most action tokens in a row; a row's valid steps come first."""
    m = action_mask.bool()
    count = m.sum(-1)
    width = int(count.max()) if m.numel() else 0
    positions = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)[:, :width]
    return positions, torch.arange(width, device=m.device)[None] < count[:, None]


class _Steps:
    """Per-token tensors compressed to action steps (env tokens dropped, so a multi-turn episode is
    one MDP), with the critic's value after the last step 0 (terminal)."""

    def __init__(self, rewards, action_mask, values, log_ratio=None):
        r, m = _check(rewards, action_mask)
        for name, x in (("values", values), ("log_ratio", log_ratio)):
            if x is not None and x.shape != r.shape:
                raise ValueError(f"{name} {tuple(x.shape)} must match rewards {tuple(r.shape)}")
        self.shape, (self.positions, self.valid) = r.shape, _action_steps(m)
        self.rewards = self.take(r)
        values = self.take(values.float())
        self.values = values  # V(s_t) [B, N]
        self.next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # V(s_{t+1}), 0 at the end
        self.ratio = torch.exp(self.take(log_ratio.float())) if log_ratio is not None else torch.ones_like(values)
        self.ratio = torch.where(self.valid, self.ratio, torch.zeros_like(self.ratio))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.valid, x.gather(1, self.positions), 0.0)

    def td_errors(self, gamma: float) -> torch.Tensor:
        """``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)`` [B, N], 0 past the last step."""
        return torch.where(self.valid, self.rewards + gamma * self.next_values - self.values, 0.0)

    def backward(self, step) -> torch.Tensor:
        """``x_t = step(t, x_{t+1})`` from the last step back, ``x_N = 0`` [B, N]."""
        out = torch.zeros_like(self.values)
        following = self.values.new_zeros(self.values.shape[0])  # [B] (N may be 0: no action token)
        for t in range(self.values.shape[1] - 1, -1, -1):
            following = torch.where(self.valid[:, t], step(t, following), 0.0)
            out[:, t] = following
        return out

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Back to ``[B, T]``, zero on env tokens."""
        return torch.zeros(self.shape, device=x.device).scatter_(1, self.positions, torch.where(self.valid, x, 0.0))

    def result(self, advantages, returns):
        return self.scatter(advantages), self.scatter(returns)


def vtrace(rewards, action_mask, values, log_ratio, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0):
    """V-trace (Espeholt et al. 2018, IMPALA, eq. 1 and Remark 1) over action tokens.

    With per-token importance ratios ``rho_t = pi(a_t|s_t) / mu(a_t|s_t)`` (``exp(log_ratio)``; ``pi``
    the policy being trained, ``mu`` the one that sampled the token), ``rho'_t = min(rho_bar,
    rho_t)`` and traces ``c_t = lam * min(c_bar, rho_t)``::

        v_s = V(s_s) + sum_{t>=s} gamma^(t-s) (prod_{i=s}^{t-1} c_i) rho'_t delta_t
        A_s = rho'_s (r_s + gamma v_{s+1} - V(s_s))

    ``returns`` are the value targets ``v_s``. Because ``A_s`` already carries ``rho'_s``, the PPO
    trainer does not apply its own importance weight on top (``actor.is_mode`` only masks).
    On-policy (``log_ratio = 0``) with ``rho_bar, c_bar >= 1``, ``v_s`` is the TD(lambda) return.

    Args:
        values: float32 ``[B, T]`` critic values ``V(s_t)`` at each token.
        log_ratio: float32 ``[B, T]``, ``log pi - log mu`` per token (0 on-policy).
        rho_bar, c_bar: clipping thresholds (``float("inf")`` for none), ``rho_bar >= c_bar > 0``
            (the paper's assumption: ``rho_bar`` sets the fixed point, ``c_bar`` the contraction speed).

    Returns:
        ``(advantages, returns)``, float32 ``[B, T]``, zero on env tokens.

    Raises:
        ValueError: ``c_bar <= 0`` or ``rho_bar < c_bar``.
    """
    if not 0 < c_bar <= rho_bar:
        raise ValueError(
            f"V-trace needs rho_bar >= c_bar > 0 (Espeholt et al. 2018), got rho_bar={rho_bar}, c_bar={c_bar}"
        )
    steps = _Steps(rewards, action_mask, values, log_ratio)
    rho = steps.ratio.clamp(max=rho_bar)
    trace = lam * steps.ratio.clamp(max=c_bar)
    weighted = rho * steps.td_errors(gamma)
    corrections = steps.backward(lambda t, following: weighted[:, t] + gamma * trace[:, t] * following)
    targets = steps.values + corrections
    next_targets = torch.cat([targets[:, 1:], torch.zeros_like(targets[:, :1])], 1)
    return steps.result(rho * (steps.rewards + gamma * next_targets - steps.values), targets)


def retrace(rewards, action_mask, values, log_ratio, gamma=1.0, lam=1.0):
    """Retrace(lambda) (Munos et al. 2016) with a state-value critic, over action tokens.

    Retrace's return for the taken action, ``Q_s = r_s + gamma [E_pi Q(s_{s+1}, .) + c_{s+1}
    (Q_{s+1} - Q(s_{s+1}, a_{s+1}))]`` with traces ``c_t = lam * min(1, rho_t)``, written with the
    critic's ``V`` for both ``E_pi Q`` and ``Q(s, a)``, gives::

        A_s = delta_s + gamma c_{s+1} A_{s+1},   delta_s = r_s + gamma V(s_{s+1}) - V(s_s)

    The sampled action itself is not reweighted (it is the one being evaluated); the trainer's
    truncated importance weight does that. On-policy it equals GAE(gamma, lam). ``returns =
    A + V``. Arguments and result as in :func:`vtrace`.
    """
    steps = _Steps(rewards, action_mask, values, log_ratio)
    delta, trace = steps.td_errors(gamma), lam * steps.ratio.clamp(max=1.0)
    next_trace = torch.cat([trace[:, 1:], torch.zeros_like(trace[:, :1])], 1)
    advantages = steps.backward(lambda t, following: delta[:, t] + gamma * next_trace[:, t] * following)
    return steps.result(advantages, advantages + steps.values)


def td_lambda(rewards, action_mask, values, gamma=1.0, lam=1.0):
    """TD(lambda) (Sutton 1988): lambda-returns ``G_t = r_t + gamma ((1 - lam) V(s_{t+1}) + lam
    G_{t+1})`` as value targets and ``A_t = G_t - V(s_t)``, over action tokens.

    The advantage equals GAE(gamma, lam) (Schulman et al. 2016, eq. 16); this is the return form,
    computed from the returns rather than the TD errors. Returns ``(advantages, returns)`` ``[B, T]``.
    """
    steps = _Steps(rewards, action_mask, values)
    bootstrap = (1 - lam) * steps.next_values
    returns = steps.backward(lambda t, following: steps.rewards[:, t] + gamma * (bootstrap[:, t] + lam * following))
    return steps.result(returns - steps.values, returns)


def clipped_is(rewards, action_mask, values, log_ratio, gamma=1.0, lam=1.0, clip_ratio=0.2):
    """Per-decision importance-sampled lambda-returns with the critic as control variate (Precup et
    al. 2000; Sutton and Barto 2018, eq. 12.26), weights clipped to ``[1 - clip_ratio, 1 + clip_ratio]``::

        G_t = w_t (r_t + gamma ((1 - lam) V(s_{t+1}) + lam G_{t+1})) + (1 - w_t) V(s_t)
        A_t = G_t - V(s_t) = w_t (delta_t + gamma lam A_{t+1}),   w_t = clip(rho_t, 1 - clip_ratio, 1 + clip_ratio)

    ``A_t`` carries the weight of its own token, so the trainer applies no importance weight on
    top. On-policy it equals GAE(gamma, lam). Arguments and result as in :func:`vtrace`.
    A ``clip_ratio`` above 1 leaves the weights unbounded below (they are positive).
    """
    steps = _Steps(rewards, action_mask, values, log_ratio)
    weight = steps.ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    delta = steps.td_errors(gamma)
    advantages = steps.backward(lambda t, following: weight[:, t] * (delta[:, t] + gamma * lam * following))
    return steps.result(advantages, advantages + steps.values)


BOOTSTRAP_METHODS = ("td", "gae", "mc")


def multistep(rewards, action_mask, values, gamma=1.0, lam=1.0, n_steps=5, bootstrap_method="td"):
    """n-step returns (Sutton and Barto 2018, ch. 7) over action tokens::

        G_t = sum_{k<n} gamma^k r_{t+k} + gamma^n B_{t+n},   A_t = G_t - V(s_t)

    where the tail estimate ``B`` is the critic's ``V(s_{t+n})`` (``bootstrap_method="td"``), the
    GAE(gamma, lam) lambda-return ``V + A^GAE`` there (``"gae"``), or the Monte-Carlo return of
    the rest of the episode (``"mc"``, so ``G_t`` is the full return for any ``n``). Past the
    episode's last action token ``B = 0``. With ``n_steps=1`` and ``"td"``, ``A_t`` is the TD(0)
    error. Returns ``(advantages, returns = G)`` ``[B, T]``.

    Raises:
        ValueError: ``n_steps < 1`` or an unknown ``bootstrap_method``.
    """
    if int(n_steps) < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if bootstrap_method not in BOOTSTRAP_METHODS:
        raise ValueError(f"bootstrap_method must be one of {BOOTSTRAP_METHODS}, got {bootstrap_method!r}")
    n, steps = int(n_steps), _Steps(rewards, action_mask, values)
    if bootstrap_method == "td":
        tail = steps.values
    elif bootstrap_method == "gae":
        delta = steps.td_errors(gamma)
        tail = steps.values + steps.backward(lambda t, following: delta[:, t] + gamma * lam * following)
    else:
        tail = steps.backward(lambda t, following: steps.rewards[:, t] + gamma * following)
    width = steps.values.shape[1]
    rewards_padded = torch.nn.functional.pad(steps.rewards, (0, n))
    tail_padded = torch.nn.functional.pad(tail, (0, n))  # 0 past the end: the episode is over
    returns = sum(gamma**k * rewards_padded[:, k : k + width] for k in range(n)) + gamma**n * tail_padded[:, n:]
    returns = torch.where(steps.valid, returns, 0.0)
    return steps.result(returns - steps.values, returns)


CRITIC_ESTIMATORS = ("gae", "vtrace", "retrace", "td_lambda", "clipped_is", "multistep")
"""Estimators that need the critic's values (the PPO trainer builds a critic for them)."""
OFF_POLICY_ESTIMATORS = ("vtrace", "retrace", "clipped_is")
"""Estimators that read the per-token importance ratio against the behaviour policy."""
WEIGHTED_ESTIMATORS = ("vtrace", "clipped_is")
"""Estimators whose advantage already carries the sampled token's importance weight."""
ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "turn_rloo", "reinforce_pp", "rebn", *CRITIC_ESTIMATORS[1:])
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "turn_rloo")
"""Estimators whose baseline is the other responses to the same prompt: a group of one has none
(every advantage is 0)."""


def compute_advantages(
    estimator: str,
    rewards,
    action_mask,
    group=None,
    values=None,
    gamma: float = 1.0,
    lam: float = 1.0,
    log_ratio=None,
    **options,
):
    """Dispatch by name (one of :data:`ESTIMATORS`). Returns ``(advantages, returns or None)``.

    ``values`` (critic estimators, :data:`CRITIC_ESTIMATORS`) and ``log_ratio`` (off-policy ones,
    :data:`OFF_POLICY_ESTIMATORS`; ``log pi - log mu`` per token, 0 when omitted) are ``[B, T]``;
    ``options`` are the estimator's own keywords (``rho_bar``, ``c_bar``, ``clip_ratio``,
    ``n_steps``, ``bootstrap_method``).

    Raises:
        ValueError: unknown estimator, a critic estimator without ``values``, or a group estimator without ``group``.
    """
    if estimator not in ESTIMATORS:
        hint = closest_hint(estimator, ESTIMATORS, otherwise=f"; choose from {ESTIMATORS}")
        raise ValueError(f"unknown advantage estimator {estimator!r}{hint}")
    if estimator in CRITIC_ESTIMATORS:
        if values is None:
            raise ValueError(f"{estimator} needs critic values")
        if estimator in OFF_POLICY_ESTIMATORS:
            options["log_ratio"] = torch.zeros_like(values) if log_ratio is None else log_ratio
        fn = {
            "gae": gae,
            "vtrace": vtrace,
            "retrace": retrace,
            "td_lambda": td_lambda,
            "clipped_is": clipped_is,
            "multistep": multistep,
        }[estimator]
        return fn(rewards, action_mask, values, gamma=gamma, lam=lam, **options)
    if estimator in ("grpo", "drgrpo", "rloo", "turn_rloo") and group is None:
        raise ValueError(f"{estimator} needs group ids")
    fn = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}.get(estimator)
    if fn is not None:
        return fn(rewards, action_mask, group), None
    if estimator == "turn_rloo":
        return _turn_rloo_tokens(rewards, action_mask, group, gamma, options.get("turn_ids")), None
    if estimator == "reinforce_pp":
        return reinforce_pp(rewards, action_mask, group, gamma), None
    return rebn(rewards, action_mask, group, gamma), None
