"""PPO-family RL trainer: rollouts on rl2gem envs, FSDP2 actor, balanced packing.

    torchrun --nproc_per_node=2 trainers/ppo.py env=rl2/ReasoningGym-v0 actor.model=smollm2-135m-instruct
    python -m rl2gem.trainers.ppo env=rl2/GSM8K-v0 rollout.prompts_per_rollout=4 trainer.total_steps=2

Defaults: ``trainers/config/ppo.yaml``; ``key=value`` overrides (unknown keys are
errors naming the closest valid one). One step:

1. rollout: every rank runs its own embedded engine (a full copy of the actor's
   weights) over ``prompts_per_rollout / world`` GRPO groups
   (:class:`rl2gem.rollout.Rollout`, token-in/token-out, prefix-merged);
2. advantages per group on the rank that made it (:mod:`rl2gem.algorithms`);
3. all sequences are shared, partitioned over ranks by Karmarkar-Karp on
   compute cost and packed into micro-batches of ``max_length_per_device``
   tokens (:mod:`rl2gem.parallel.packing`);
4. old (and reference) log-probs, then ``update_per_rollout`` passes of the PPO
   loss (clip-higher, dual clip, KL k1/k2/k3, entropy, importance sampling
   against the rollout log-probs), FSDP2 gradients, clipping, AdamW;
5. weight sync into every rank's engine; periodic evaluation; logging.

CPU runs use gloo and float32; GPU runs NCCL and bfloat16.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

CONFIG = Path(__file__).with_name("config") / "ppo.yaml"


def _dtype(name: str, device: torch.device):
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[name]


_SUMMED = {
    f"rollout/{k}" for k in ("groups", "episodes", "tokens", "action_tokens", "sequences", "splits", "requests",
                             "aborted_requests", "groups_started", "dropped_stale", "carried_over", "in_flight_after", "ready_after")
}


class Sample:
    """One training sequence with everything the loss needs (python lists, length L)."""

    __slots__ = ("ids", "mask", "rollout_lp", "adv", "rewards", "versions", "returns")

    def __init__(self, ids, mask, rollout_lp, adv, rewards, versions):
        self.ids, self.mask, self.rollout_lp, self.adv, self.rewards, self.versions = ids, mask, rollout_lp, adv, rewards, versions
        self.returns = None


def samples_from_batch(batch, estimator: str, gamma: float, lam: float) -> list[Sample]:
    """Advantages for every sequence of a rollout batch (groups are complete on this rank).

    With ``gae`` the advantages are left as ``None``: they need the critic's values, which the
    trainer computes per micro-batch (:func:`apply_gae`)."""
    from rl2gem.algorithms import compute_advantages

    seqs, rows, group_ids = [], [], []
    outcome = estimator in ("grpo", "drgrpo", "rloo")
    for g, episodes in enumerate(batch.groups):
        for ep in episodes:
            for s in ep.sequences:
                r = list(s.rewards)
                if outcome:  # every sequence of the episode is scored by the episode's return
                    r = [0.0] * len(r)
                    last = max((i for i, m in enumerate(s.action_mask) if m), default=len(r) - 1)
                    r[last] = ep.reward
                seqs.append(s)
                rows.append(r)
                group_ids.append(g)
    if not seqs:
        return []
    T = max(len(s) for s in seqs)
    rewards = torch.zeros(len(seqs), T)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, r) in enumerate(zip(seqs, rows)):
        rewards[i, : len(r)] = torch.tensor(r)
        mask[i, : len(s)] = torch.tensor(s.action_mask, dtype=torch.bool)
    if estimator == "gae":  # per-token rewards as the env gave them; advantages after the critic
        return [Sample(s.input_ids, s.action_mask, s.logprobs, None, rows[i], s.versions) for i, s in enumerate(seqs)]
    adv, _ = compute_advantages(estimator, rewards, mask, torch.tensor(group_ids), gamma=gamma, lam=lam)
    return [
        Sample(s.input_ids, s.action_mask, s.logprobs, adv[i, : len(s)].tolist(), rows[i], s.versions)
        for i, s in enumerate(seqs)
    ]


def _packed_inputs(model, samples: list[Sample], device):
    """One packed row of ``samples`` (no padding) and the model's keyword arguments: flash-attn
    varlen reads the sequence boundaries from ``position_ids``; other attention gets a 4D
    block-diagonal causal mask."""
    from rl2gem.parallel.packing import packed_attention_mask, packed_batch

    batch = packed_batch([s.ids for s in samples])
    kw = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device), "use_cache": False}
    if not (device.type == "cuda" and getattr(model.config, "_attn_implementation", "") == "flash_attention_2"):
        kw["attention_mask"] = packed_attention_mask(batch["cu_seqlens"], dtype=next(model.parameters()).dtype).to(device)
    return batch, kw


def token_logprobs(model, samples: list[Sample], temperature: float, device, entropy: str = "none"):
    """Packed forward of ``samples``: per-token log-probs ``[N]`` float32 aligned to input positions
    (0 at each sequence's first token), and per-token entropies (nats) when ``entropy`` is
    ``"grad"`` (differentiable, for an entropy bonus) or ``"metric"`` (detached), else ``None``."""
    from rl2gem.algorithms import entropy_from_logits

    batch, kw = _packed_inputs(model, samples, device)
    ids = kw["input_ids"]
    logits = model(**kw).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    out = torch.cat([torch.zeros(1, device=lp.device), lp])
    out = torch.where(batch["position_ids"][0].to(device) == 0, torch.zeros_like(out), out)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            src = logits[:-1] if entropy == "grad" else logits[:-1].detach()
            ent = torch.cat([torch.zeros(1, device=lp.device), entropy_from_logits(src)])
    return out, ent


def token_values(critic, samples: list[Sample], device) -> torch.Tensor:
    """Packed critic forward: float32 ``[N]`` values aligned like :func:`token_logprobs`: entry t is
    V(state before token t), read from the hidden state at t-1 (0 at each sequence's first token)."""
    batch, kw = _packed_inputs(critic, samples, device)
    v = critic(**kw).logits[0, :, 0].float()
    out = torch.cat([torch.zeros(1, device=v.device), v[:-1]])
    return torch.where(batch["position_ids"][0].to(device) == 0, torch.zeros_like(out), out)


def apply_gae(samples: list[Sample], values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE advantages and returns of packed ``samples`` from their critic ``values`` ``[N]``;
    sets ``sample.adv`` / ``sample.returns`` and returns the packed returns ``[N]``."""
    from rl2gem.algorithms import gae

    rets, start = [], 0
    for s in samples:
        n = len(s.ids)
        adv, ret = gae(torch.tensor([s.rewards]), torch.tensor([s.mask], dtype=torch.bool), values[None, start : start + n].cpu(), gamma, lam)
        s.adv, s.returns = adv[0].tolist(), ret[0].tolist()
        rets.append(ret[0])
        start += n
    return torch.cat(rets).to(values.device)


def token_weights(samples: list[Sample], mode: str, norm: float, totals: dict[str, float]) -> torch.Tensor:
    """Per-token loss weights reproducing ``aggregate(mode)`` over the *global* batch."""
    w = []
    for s in samples:
        n = sum(s.mask)
        for m in s.mask:
            if not m:
                w.append(0.0)
            elif mode == "token_mean":
                w.append(1.0 / totals["tokens"])
            elif mode == "seq_mean_token_sum":
                w.append(1.0 / totals["seqs"])
            elif mode == "seq_mean_token_mean":
                w.append(1.0 / (totals["seqs"] * n))
            elif mode == "seq_mean_token_sum_norm":
                w.append(1.0 / (totals["seqs"] * norm))
            else:
                raise ValueError(f"unknown loss aggregation {mode!r}")
    return torch.tensor(w)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write a file so that a crash leaves the old content or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def check_config(cfg) -> None:
    """Combinations of values that cannot work together.

    Raises:
        rl2gem.config.ConfigError: with the keys to change.
    """
    from rl2gem.algorithms import ESTIMATORS
    from rl2gem.config import ConfigError

    if cfg.adv.estimator not in ESTIMATORS:
        raise ConfigError(f"adv.estimator={cfg.adv.estimator!r} is not one of {list(ESTIMATORS)}")
    if cfg.kl.in_reward and cfg.kl.coef > 0 and cfg.adv.estimator != "gae":
        raise ConfigError(f"kl.in_reward=true needs token-level credit (adv.estimator=gae), got adv.estimator={cfg.adv.estimator}; "
                          "use kl.in_reward=false (a KL loss term) with outcome estimators")


class PPOTrainer:
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    def __init__(self, cfg):
        from rl2gem.parallel.fsdp import device_mesh, init_distributed, load_sharded

        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed()
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", self.world))))
        torch.manual_seed(cfg.seed)
        check_config(cfg)
        if cfg.rollout.prompts_per_rollout % self.world:
            raise ValueError(f"rollout.prompts_per_rollout={cfg.rollout.prompts_per_rollout} must be a multiple of the world size {self.world}")
        self.out = Path(cfg.trainer.output_dir)
        self.dtype = _dtype(cfg.actor.dtype, self.device)
        self.mesh = device_mesh(cfg.actor.ddp_size)
        a = cfg.actor
        kw = dict(device=self.device, dtype=self.dtype, cpu_offload=a.cpu_offload, reshard_after_forward=a.reshard_after_forward)
        self.actor = load_sharded(a.model, self.mesh, gradient_checkpointing=a.gradient_checkpointing, **kw)
        self.ref = load_sharded(a.model, self.mesh, **kw).eval() if cfg.kl.coef > 0 else None
        self.opt = torch.optim.AdamW(self.actor.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        warm = max(0, int(a.warmup_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.critic = self.critic_opt = None
        if cfg.adv.estimator == "gae":  # a critic only where GAE needs one
            cr = cfg.critic
            self.critic = load_sharded(cr.model or a.model, self.mesh, head="value", gradient_checkpointing=a.gradient_checkpointing, **kw)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cr.lr, weight_decay=cr.weight_decay)
        self.step = 0
        self.loop = asyncio.new_event_loop()
        self._build_rollout()
        self.tracker = None
        if self.rank == 0:

            from rl2gem.tracking import Tracker

            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
            self.tracker = Tracker(cfg.trainer.loggers, self.out, OmegaConf.to_container(cfg, resolve=True))

    # ------------------------------------------------------------------ rollout side
    def _build_rollout(self):
        from rl2gem.models import load_model
        from rl2gem.parallel.fsdp import full_state_dict
        from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig

        c = self.cfg
        model, self.tokenizer = load_model(c.actor.model, dtype=torch.float32 if self.device.type == "cpu" else self.dtype,
                                           device=str(self.device))
        model.load_state_dict(full_state_dict(self.actor), strict=False)
        self.engine = EmbeddedEngine(model, self.tokenizer, seed=c.seed * 1000 + self.rank)
        r = c.rollout
        self.rollout_cfg = RolloutConfig(
            responses_per_prompt=r.responses_per_prompt, max_new_tokens=r.max_new_tokens, max_length=r.max_length,
            temperature=r.temperature, top_p=r.top_p, concurrency=r.concurrency, partial_rollout=r.partial_rollout,
            partial_oversample=r.partial_oversample, max_staleness=r.max_staleness, dynamic_filter=r.dynamic_filter,
            system_prompt=r.system_prompt, tools_in_template=r.tools_in_template, seed=c.seed * 1000 + self.rank,
            progress=False,
        )
        import rl2gem
        from rl2gem.rollout.tito import load_chat_template

        env_kwargs = rl2gem.standard_kwargs(c.env, OmegaConf.to_container(c.env_kwargs, resolve=True),
                                            tools_in_template=r.tools_in_template)
        self.rollout = Rollout(self.engine, self.tokenizer, c.env, self.rollout_cfg, env_kwargs=env_kwargs,
                               chat_template=load_chat_template(r.chat_template))

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        from rl2gem.algorithms import importance_weights, kl_estimate, policy_loss, value_loss
        from rl2gem.parallel.fsdp import full_state_dict
        from rl2gem.parallel.packing import plan

        c, a = self.cfg, self.cfg.actor
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        batch = self._run(self.rollout.collect(c.rollout.prompts_per_rollout // self.world))
        t_roll = time.perf_counter() - t0
        local = samples_from_batch(batch, c.adv.estimator, c.adv.gamma, c.adv.lam)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (local, batch.metrics))
        samples = [s for part, _ in gathered for s in part]
        for key in batch.metrics:
            vals = [m[key] for _, m in gathered]
            metrics[key] = sum(vals) if key in _SUMMED else sum(vals) / len(vals)
        metrics["time/rollout"] = t_roll
        if not samples:
            return metrics
        lengths = [len(s.ids) for s in samples]
        mbs = plan(lengths, self.world, max(a.max_length_per_device, max(lengths)))[self.rank]
        totals = {"tokens": float(sum(sum(s.mask) for s in samples)), "seqs": float(len(samples))}
        norm = float(c.rollout.max_length)
        temp = c.rollout.temperature or 1.0
        # old / reference log-probs
        t1 = time.perf_counter()
        old, ref = [], []
        with torch.no_grad():
            for mb in mbs:
                part = [samples[i] for i in mb] or [samples[0]]
                old.append(token_logprobs(self.actor, part, temp, self.device)[0])
                if self.ref is not None:
                    ref.append(token_logprobs(self.ref, part, temp, self.device)[0])
            old_v, rets = [], []
            if self.critic is not None:
                vs = []
                for k, mb in enumerate(mbs):
                    part = [samples[i] for i in mb] or [samples[0]]
                    if mb and self.ref is not None and c.kl.in_reward:  # r_t -= coef * KL_t(actor || ref) on action tokens
                        kl_tok, start = kl_estimate(old[k], ref[k], c.kl.estimator).cpu(), 0
                        for s_ in part:
                            n_ = len(s_.ids)
                            s_.rewards = [r_ - c.kl.coef * float(x) * m_ for r_, x, m_ in zip(s_.rewards, kl_tok[start : start + n_], s_.mask)]
                            start += n_
                    v = token_values(self.critic, part, self.device)
                    old_v.append(v)
                    rets.append(apply_gae(part, v, c.adv.gamma, c.adv.lam))
                    m_ = torch.tensor([m for s_ in part for m in s_.mask], dtype=torch.bool, device=v.device)
                    vs.append((float((v * m_).sum()), float(m_.sum())))
                metrics["critic/values"] = sum(x for x, _ in vs) / max(sum(n for _, n in vs), 1.0)
        metrics["time/old_logprobs"] = time.perf_counter() - t1
        # updates
        t2 = time.perf_counter()
        chunks = max(1, int(a.minibatches_per_update))
        per = math.ceil(len(mbs) / chunks)
        agg = {"pg_loss": 0.0, "clip_ratio": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0, "mismatch_kl": 0.0}
        cagg = {"vf_loss": 0.0, "vf_clip_ratio": 0.0, "grad_norm": 0.0}
        count = 0
        grad_norm = 0.0
        for _ in range(int(a.update_per_rollout)):
            for start in range(0, len(mbs), per):
                for k in range(start, min(start + per, len(mbs))):
                    mb = mbs[k]
                    empty = not mb
                    part = [samples[i] for i in mb] or [samples[0]]
                    lp, ent = token_logprobs(self.actor, part, temp, self.device, entropy="grad" if a.entropy_coef > 0 else "metric")
                    mask = torch.tensor([m for s in part for m in s.mask], dtype=torch.bool, device=lp.device)
                    adv = torch.tensor([x for s in part for x in s.adv], device=lp.device)
                    roll = torch.tensor([x for s in part for x in s.rollout_lp], device=lp.device)
                    w = token_weights(part, a.loss_agg, norm, totals).to(lp.device) * (0.0 if empty else 1.0)
                    isw, mask_is = importance_weights(old[k], roll, mask, c.rollout.is_mode, c.rollout.is_cap)
                    loss, m = policy_loss(
                        lp[None], old[k][None], adv[None], mask_is[None], clip_low=a.clip_low, clip_high=a.clip_high,
                        dual_clip=a.dual_clip, is_weights=isw[None], token_weights=w[None],
                    )
                    if self.ref is not None:
                        kl = kl_estimate(lp, ref[k], c.kl.estimator)
                        if not c.kl.in_reward:
                            loss = loss + c.kl.coef * (kl * w * mask).sum()
                        agg["kl"] += float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
                    if a.entropy_coef > 0:
                        loss = loss - a.entropy_coef * (ent * w * mask).sum()
                    (loss * self.world).backward()  # FSDP averages gradients over ranks
                    n = mask.sum().clamp(min=1)
                    agg["pg_loss"] += m["pg_loss"]
                    agg["clip_ratio"] += m["clip_ratio"]
                    agg["entropy"] += float((ent.detach() * mask).sum() / n)
                    agg["is_weight"] += float((isw * mask).sum() / n)
                    agg["mismatch_kl"] += float((kl_estimate(roll, old[k], "k3") * mask).sum() / n)
                    if self.critic is not None:
                        v = token_values(self.critic, part, self.device)
                        vloss, vm = value_loss(v, old_v[k], rets[k], mask, clip=c.critic.value_clip, token_weights=w)
                        (vloss * self.world).backward()
                        cagg["vf_loss"] += vm["vf_loss"]
                        cagg["vf_clip_ratio"] += vm["vf_clip_ratio"]
                    count += 1
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.actor.parameters(), a.max_grad_norm))
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                if self.critic is not None:
                    cagg["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), c.critic.max_grad_norm))
                    self.critic_opt.step()
                    self.critic_opt.zero_grad(set_to_none=True)
        metrics["time/update"] = time.perf_counter() - t2
        if self.critic is not None:
            metrics["critic/vf_loss"] = cagg["vf_loss"] / max(count, 1)
            metrics["critic/vf_clip_ratio"] = cagg["vf_clip_ratio"] / max(count, 1)
            metrics["critic/grad_norm"] = cagg["grad_norm"]
        for key, v in agg.items():
            metrics[f"actor/{key}"] = v / max(count, 1)
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/lr"] = self.sched.get_last_lr()[0]
        # weight sync
        t3 = time.perf_counter()
        sd = full_state_dict(self.actor)
        self.step += 1
        self._run(self.engine.update_weights(sd, version=self.step))
        metrics["time/weight_sync"] = time.perf_counter() - t3
        step_time = time.perf_counter() - t0
        tokens = sum(lengths)
        n_params = sum(p.numel() for p in self.engine.model.parameters())
        models = 1 + (self.critic is not None)  # the critic has the actor's backbone
        flops = 2 * n_params * metrics.get("rollout/action_tokens", 0) + 2 * n_params * tokens * (models + (self.ref is not None)) \
            + 6 * n_params * tokens * int(a.update_per_rollout) * models
        metrics["perf/tokens_per_second"] = tokens / step_time
        metrics["perf/mfu"] = flops / step_time / float(c.trainer.peak_flops)
        metrics["time/step"] = step_time
        metrics = self._reduce(metrics)
        return metrics

    def _reduce(self, metrics):
        """Average the per-rank actor metrics (rollout metrics are already global)."""
        keys = sorted(k for k in metrics if k.startswith(("actor/", "critic/", "time/", "perf/")))
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        for k, v in zip(keys, (t / self.world).tolist()):
            metrics[k] = v
        return metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Greedy episodes on the test split, spread over ranks; success rate and mean reward."""
        import rl2gem
        from rl2gem.rollout import Rollout, RolloutConfig

        c = self.cfg
        kwargs = OmegaConf.to_container(c.env_kwargs, resolve=True)
        kwargs.update(OmegaConf.to_container(c.eval_env_kwargs, resolve=True))
        kwargs = rl2gem.standard_kwargs(c.env, kwargs, split=c.trainer.eval_split, tools_in_template=c.rollout.tools_in_template)
        rcfg = RolloutConfig(responses_per_prompt=1, max_new_tokens=c.rollout.max_new_tokens, max_length=c.rollout.max_length,
                             temperature=0.0, concurrency=c.rollout.concurrency, system_prompt=c.rollout.system_prompt,
                             tools_in_template=c.rollout.tools_in_template)
        ro = Rollout(self.engine, self.tokenizer, lambda: rl2gem.make(c.env, **kwargs), rcfg,
                     chat_template=self.rollout.renderer.chat_template)  # the training rollout's template
        probe = rl2gem.make(c.env, **kwargs)
        indexed = hasattr(probe.unwrapped, "__len__")
        n = min(c.trainer.eval_n, len(probe.unwrapped)) if indexed else c.trainer.eval_n
        probe.close()
        mine = list(range(self.rank, n, self.world))
        resets = [(10_000_019 + i, {"index": i} if indexed else None) for i in mine]
        episodes = self._run(ro.play(resets))
        self._run(ro.close())
        t = torch.tensor([sum(e.reward for e in episodes), sum(e.reward > 0 for e in episodes), len(episodes)], dtype=torch.float64)
        dist.all_reduce(t)
        return {"eval/reward": float(t[0] / t[2]), "eval/success": float(t[1] / t[2]), "eval/episodes": float(t[2])}

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint ``output_dir/checkpoint-<step>``: a sharded DCP of model and optimizer
        (``dcp/``), the scheduler and step (``trainer_state.json``), each rank's rollout
        position, partial-rollout buffer and RNG states (``rank<r>.pkl``), and a Hugging Face
        export (``hf/``). ``latest`` is written last, so a run killed while saving resumes from
        the previous checkpoint."""
        import pickle

        import torch.distributed.checkpoint as dcp

        from rl2gem.parallel.fsdp import full_state_dict

        path = self.out / f"checkpoint-{self.step}"
        dcp.save(self._dcp_state(), checkpoint_id=str(path / "dcp"))
        local = {
            "rollout": self.rollout.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "engine_rng": self.engine._gen.get_state(),
        }
        _atomic_write(path / f"rank{self.rank}.pkl", pickle.dumps(local))
        full = full_state_dict(self.actor)
        if self.rank == 0:
            _atomic_write(path / "trainer_state.json", json.dumps({"step": self.step, "scheduler": self.sched.state_dict()}).encode())
            hf = path / "hf"
            self.engine.model.save_pretrained(hf, state_dict=full)
            self.tokenizer.save_pretrained(hf)
        dist.barrier()
        if self.rank == 0:
            _atomic_write(self.out / "latest", path.name.encode())
        dist.barrier()
        return path

    def _dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.actor, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic"], state["critic_optim"] = get_state_dict(self.critic, self.critic_opt)
        return state

    def load(self) -> bool:
        """Resume from ``output_dir/latest`` (see :meth:`save`); False when there is none.

        Raises:
            FileNotFoundError: the checkpoint was written by a run with another world size.
        """
        import pickle

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from rl2gem.parallel.fsdp import full_state_dict

        latest = self.out / "latest"
        if not latest.exists():
            return False
        path = self.out / latest.read_text().strip()
        mine = path / f"rank{self.rank}.pkl"
        if not mine.exists():
            raise FileNotFoundError(f"{mine} is missing: resume with the world size that wrote {path}")
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.actor, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.critic is not None:
            set_state_dict(self.critic, self.critic_opt, model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])
        meta = json.loads((path / "trainer_state.json").read_text())
        self.step = meta["step"]
        self.sched.load_state_dict(meta["scheduler"])
        local = pickle.loads(mine.read_bytes())
        self.rollout.load_state_dict(local["rollout"])
        torch.set_rng_state(local["torch_rng"])
        self.engine._gen.set_state(local["engine_rng"])
        self._run(self.engine.update_weights(full_state_dict(self.actor), version=self.step))
        return True

    # ------------------------------------------------------------------ main loop
    def fit(self) -> dict[str, float]:
        c = self.cfg.trainer
        if c.resume and self.load() and self.rank == 0:
            print(f"resumed from step {self.step}", flush=True)
        last = {}
        from tqdm.auto import tqdm

        if c.eval_at_start and self.step == 0:
            start = self.evaluate()
            if self.tracker:
                self.tracker.log(start, 0)
        bar = tqdm(total=c.total_steps, initial=self.step, desc="ppo", disable=not (c.progress and self.rank == 0))
        while self.step < c.total_steps:
            m = self.train_step()
            if c.eval_every and self.step % c.eval_every == 0 and self.step < c.total_steps:
                m.update(self.evaluate())
            if c.save_every and self.step % c.save_every == 0:
                self.save()
            if self.tracker:
                self.tracker.log(m, self.step)
            bar.update(1)
            last = m
        bar.close()
        final = self.evaluate()
        ckpt = self.save()
        if self.tracker:
            self.tracker.log(final, self.step)
            self.tracker.close()
            from rl2gem.tracking import metrics_table, plot_metrics

            png = plot_metrics(self.tracker.path, self.out / "curves.png")
            print("\n" + metrics_table(self.tracker.path))
            print(f"\nfinal eval: success {final['eval/success']:.3f}  reward {final['eval/reward']:.3f}  ({int(final['eval/episodes'])} episodes)")
            print(f"metrics: {self.tracker.path}\nplot: {png}\ncheckpoint: {ckpt} (Hugging Face export: {ckpt / 'hf'})", flush=True)
        last.update(final)
        return last

    def close(self):
        self._run(self.rollout.close())
        self._run(self.engine.close())
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    from rl2gem.config import ConfigError, load_config

    try:
        cfg = load_config(CONFIG, sys.argv[1:] if argv is None else argv)
        check_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer = PPOTrainer(cfg)
    if trainer.rank == 0:

        print(OmegaConf.to_yaml(cfg), flush=True)
    try:
        trainer.fit()
    finally:
        trainer.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
