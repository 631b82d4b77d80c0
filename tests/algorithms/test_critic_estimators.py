"""Critic estimators (V-trace, Retrace, TD(lambda), clipped IS, n-step) against loop-form references
written from the papers' definitions (sums and products, not the library's recursions), and their
identities (on-policy V-trace = TD(lambda) returns, n-step with n=1 = TD(0), Retrace/clipped IS
on-policy = GAE)."""

import math
import random

import pytest
import torch

from rl2gem.algorithms import (
    clipped_is,
    compute_advantages,
    gae,
    multistep,
    retrace,
    returns_to_go,
    td_lambda,
    vtrace,
)

GAMMA, LAM = 0.9, 0.8


def episode_batch(seed=0):
    """Three multi-turn rows: action tokens (mask 1) broken by env tokens, rewards on the last token
    of each turn, values and log-ratios everywhere (the estimators must ignore env tokens)."""
    rng = random.Random(seed)
    masks = [
        [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0],
    ]
    rewards = [[0.0] * len(m) for m in masks]
    for row, m in zip(rewards, masks, strict=True):
        for t in range(len(m)):
            if m[t] and (t + 1 == len(m) or not m[t + 1]):
                row[t] = rng.choice([-1.0, 0.5, 1.0])
    values = [[rng.uniform(-1, 1) for _ in m] for m in masks]
    log_ratio = [[rng.uniform(-0.7, 0.7) for _ in m] for m in masks]
    tensor = torch.tensor
    return tensor(rewards), tensor(masks, dtype=torch.bool), tensor(values), tensor(log_ratio)


def steps_of(rewards, mask, values, log_ratio):
    """Per row: the action steps as python lists (r, V, rho) and their positions."""
    rows = []
    for b in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[b, t]]
        rows.append(
            (
                idx,
                [float(rewards[b, t]) for t in idx],
                [float(values[b, t]) for t in idx] + [0.0],  # terminal value 0
                [math.exp(float(log_ratio[b, t])) for t in idx],
            )
        )
    return rows


def scatter(rows_values, mask):
    out = torch.zeros(mask.shape)
    for b, (idx, vals) in enumerate(rows_values):
        for t, v in zip(idx, vals, strict=True):
            out[b, t] = v
    return out


def reference_vtrace(r, v, rho, gamma, lam, rho_bar, c_bar):
    n = len(r)
    rho_c = [min(rho_bar, x) for x in rho]
    c = [lam * min(c_bar, x) for x in rho]
    delta = [rho_c[t] * (r[t] + gamma * v[t + 1] - v[t]) for t in range(n)]
    vs = []
    for s in range(n):
        total = v[s]
        for t in range(s, n):
            total += gamma ** (t - s) * math.prod(c[s:t]) * delta[t]
        vs.append(total)
    vs.append(0.0)
    adv = [rho_c[s] * (r[s] + gamma * vs[s + 1] - v[s]) for s in range(n)]
    return adv, vs[:n]


def reference_retrace(r, v, rho, gamma, lam):
    n = len(r)
    c = [lam * min(1.0, x) for x in rho]
    delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
    adv = [sum(gamma ** (t - s) * math.prod(c[s + 1 : t + 1]) * delta[t] for t in range(s, n)) for s in range(n)]
    return adv, [a + v[s] for s, a in enumerate(adv)]


def reference_lambda_return(r, v, gamma, lam):
    """Forward view: G^lambda_t = (1 - lam) sum_n lam^(n-1) G^(n)_t + lam^(N-t-1) G_t (Sutton & Barto eq. 12.3)."""
    n = len(r)

    def n_step(t, k):
        end = min(t + k, n)
        g = sum(gamma ** (i - t) * r[i] for i in range(t, end))
        return g + (gamma**k * v[t + k] if t + k < n else 0.0)

    out = []
    for t in range(n):
        horizon = n - t
        g = sum((1 - lam) * lam ** (k - 1) * n_step(t, k) for k in range(1, horizon))
        out.append(g + lam ** (horizon - 1) * n_step(t, horizon))
    return out


def reference_clipped_is(r, v, rho, gamma, lam, clip):
    n = len(r)
    w = [min(max(x, 1 - clip), 1 + clip) for x in rho]
    g = [0.0] * (n + 1)
    g[n] = 0.0
    for t in range(n - 1, -1, -1):  # Sutton & Barto eq. 12.26 with the lambda mixture of G_{t+1}
        target = r[t] + gamma * ((1 - lam) * v[t + 1] + lam * (g[t + 1] if t + 1 < n else 0.0))
        g[t] = w[t] * target + (1 - w[t]) * v[t]
    return [g[t] - v[t] for t in range(n)], g[:n]


def reference_multistep(r, v, gamma, n_steps, bootstrap, lam):
    n = len(r)
    mc = [sum(gamma ** (i - t) * r[i] for i in range(t, n)) for t in range(n)]
    lam_ret = reference_lambda_return(r, v, gamma, lam)
    tail = {"td": v[:n], "mc": mc, "gae": lam_ret}[bootstrap]
    out = []
    for t in range(n):
        g = sum(gamma**k * r[t + k] for k in range(n_steps) if t + k < n)
        if t + n_steps < n:
            g += gamma**n_steps * tail[t + n_steps]
        out.append(g)
    return [g - v[t] for t, g in enumerate(out)], out


def expected(references, mask):
    """The reference advantages and returns as ``[B, T]`` tensors (0 on env tokens)."""
    advantages = scatter([(idx, a) for idx, (a, _) in references], mask)
    returns = scatter([(idx, g) for idx, (_, g) in references], mask)
    return advantages, returns


TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize(("rho_bar", "c_bar", "lam"), [(1.0, 1.0, 1.0), (1.5, 0.9, LAM), (math.inf, math.inf, LAM)])
def test_vtrace_matches_the_papers_sum(rho_bar, c_bar, lam):
    rewards, mask, values, log_ratio = episode_batch()
    rows = steps_of(rewards, mask, values, log_ratio)
    refs = [(idx, reference_vtrace(r, v, rho, GAMMA, lam, rho_bar, c_bar)) for idx, r, v, rho in rows]
    adv, ret = vtrace(rewards, mask, values, log_ratio, GAMMA, lam, rho_bar, c_bar)
    ref_adv, ref_ret = expected(refs, mask)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


def test_retrace_matches_the_sum_of_traced_td_errors():
    rewards, mask, values, log_ratio = episode_batch(1)
    rows = steps_of(rewards, mask, values, log_ratio)
    refs = [(idx, reference_retrace(r, v, rho, GAMMA, LAM)) for idx, r, v, rho in rows]
    adv, ret = retrace(rewards, mask, values, log_ratio, GAMMA, LAM)
    ref_adv, ref_ret = expected(refs, mask)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


def test_td_lambda_is_the_forward_view_lambda_return():
    rewards, mask, values, _ = episode_batch(2)
    rows = steps_of(rewards, mask, values, torch.zeros_like(values))
    refs = []
    for idx, r, v, _ in rows:
        g = reference_lambda_return(r, v, GAMMA, LAM)
        refs.append((idx, ([g[t] - v[t] for t in range(len(r))], g)))
    adv, ret = td_lambda(rewards, mask, values, GAMMA, LAM)
    ref_adv, ref_ret = expected(refs, mask)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


@pytest.mark.parametrize("clip", [0.2, 10.0])
def test_clipped_is_matches_per_decision_importance_sampling(clip):
    rewards, mask, values, log_ratio = episode_batch(3)
    rows = steps_of(rewards, mask, values, log_ratio)
    refs = [(idx, reference_clipped_is(r, v, rho, GAMMA, LAM, clip)) for idx, r, v, rho in rows]
    adv, ret = clipped_is(rewards, mask, values, log_ratio, GAMMA, LAM, clip)
    ref_adv, ref_ret = expected(refs, mask)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


@pytest.mark.parametrize("bootstrap", ["td", "gae", "mc"])
@pytest.mark.parametrize("n_steps", [1, 3, 50])
def test_multistep_matches_n_step_returns(n_steps, bootstrap):
    rewards, mask, values, _ = episode_batch(4)
    rows = steps_of(rewards, mask, values, torch.zeros_like(values))
    refs = [(idx, reference_multistep(r, v, GAMMA, n_steps, bootstrap, LAM)) for idx, r, v, _ in rows]
    adv, ret = multistep(rewards, mask, values, GAMMA, LAM, n_steps, bootstrap)
    ref_adv, ref_ret = expected(refs, mask)
    torch.testing.assert_close(adv, ref_adv, **TOL)
    torch.testing.assert_close(ret, ref_ret, **TOL)


def test_on_policy_identities():
    rewards, mask, values, _ = episode_batch(5)
    on_policy = torch.zeros_like(values)
    gae_adv, gae_ret = gae(rewards, mask, values, GAMMA, LAM)
    # on-policy V-trace with no clipping: the value targets are TD(lambda) returns, and with lam=1
    # the Monte-Carlo returns (rewards-to-go over action tokens)
    _, vs = vtrace(rewards, mask, values, on_policy, GAMMA, LAM, math.inf, math.inf)
    torch.testing.assert_close(vs, td_lambda(rewards, mask, values, GAMMA, LAM)[1])
    _, vs1 = vtrace(rewards, mask, values, on_policy, GAMMA, 1.0, math.inf, math.inf)
    torch.testing.assert_close(vs1, returns_to_go(rewards, mask, GAMMA))
    # TD(lambda), Retrace and clipped IS on-policy are GAE (Schulman et al. 2016, eq. 16)
    for fn in (
        lambda: td_lambda(rewards, mask, values, GAMMA, LAM),
        lambda: retrace(rewards, mask, values, on_policy, GAMMA, LAM),
        lambda: clipped_is(rewards, mask, values, on_policy, GAMMA, LAM),
    ):
        adv, ret = fn()
        torch.testing.assert_close(adv, gae_adv)
        torch.testing.assert_close(ret, gae_ret)
    # one-step returns bootstrapped with V: the TD(0) error, = GAE with lam = 0
    torch.testing.assert_close(
        multistep(rewards, mask, values, GAMMA, n_steps=1)[0], gae(rewards, mask, values, GAMMA, 0.0)[0]
    )


def test_env_tokens_get_nothing_and_a_stale_token_is_corrected_by_its_own_ratio():
    rewards, mask, values, log_ratio = episode_batch(6)
    for name in ("vtrace", "retrace", "td_lambda", "clipped_is", "multistep"):
        adv, ret = compute_advantages(name, rewards, mask, values=values, log_ratio=log_ratio, gamma=GAMMA, lam=LAM)
        assert not adv[~mask].any() and not ret[~mask].any(), name
    # one token of the first row came from an older policy that gave it e^2 times the probability pi
    # gives it now (rho = e^-2): its own weight and the traces through it change, nothing later does
    stale = log_ratio.clone()
    stale[0, 3] = -2.0
    adv, _ = vtrace(rewards, mask, values, log_ratio, GAMMA, 1.0, rho_bar=1.0, c_bar=1.0)
    adv2, _ = vtrace(rewards, mask, values, stale, GAMMA, 1.0, rho_bar=1.0, c_bar=1.0)
    assert torch.equal(adv[1:], adv2[1:]) and torch.equal(adv[0, 4:], adv2[0, 4:])  # later tokens: unchanged
    assert not torch.equal(adv[0, :4], adv2[0, :4])


def test_errors():
    rewards, mask, values, log_ratio = episode_batch()
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("vtrace", rewards, mask)
    with pytest.raises(ValueError, match="did you mean 'vtrace'"):
        compute_advantages("v_trace", rewards, mask, values=values)
    with pytest.raises(ValueError, match="log_ratio"):
        vtrace(rewards, mask, values, log_ratio[:, :3])
    with pytest.raises(ValueError, match="n_steps"):
        multistep(rewards, mask, values, n_steps=0)
    with pytest.raises(ValueError, match="bootstrap_method"):
        multistep(rewards, mask, values, bootstrap_method="lambda")
