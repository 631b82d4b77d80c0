"""The training core every trainer shares (``trainers/ppo.py``, ``trainers/sft.py``, ...).

* :mod:`~rl2gem.training.worker`: models on the named device mesh (FSDP2/HSDP, CPU offload,
  activation checkpointing), optimizer, scheduler, gradient clipping, HF export;
* :mod:`~rl2gem.training.forward`: the micro-batch planner (Karmarkar-Karp over compute cost),
  placeholders for ranks without a real sequence, packed per-token log-probs, entropies, values,
  sequence scores of a reward model and per-sequence sums;
* :mod:`~rl2gem.training.pairs`: preference pairs (chosen and rejected packed together);
* :mod:`~rl2gem.training.samples`: training samples, RL samples from rollout batches, GAE;
* loss weighting: :func:`rl2gem.algorithms.loss_weights` (one implementation for
  ``aggregate`` and the global-batch token weights);
* :mod:`~rl2gem.training.checkpoint`: save / resume (models, optimizers, schedulers, RNGs,
  data position, rollout buffer), atomically;
* :mod:`~rl2gem.training.evaluation`: the env evaluation shared with ``python -m rl2gem.evaluate``;
* :mod:`~rl2gem.training.metrics`: averages over micro-batches and ranks, FLOPs and MFU;
* :mod:`~rl2gem.training.trainer`: the outer loop (resume, evaluation, checkpoints, logging, the
  end-of-run report) and the command line of every trainer;
* :mod:`~rl2gem.training.offline`: the base of the trainers over a fixed data set (SFT, RM, DPO);
* :mod:`~rl2gem.training.online`: the base of the online RL trainers (PPO family): workers, engine,
  rollout, reward shaping, weight sync; :mod:`~rl2gem.training.rl_config` checks their config and
  builds its KL controller, constraints and objectives; :mod:`~rl2gem.training.old_logprobs`
  chooses the PPO ratio's denominator.
"""

from rl2gem.parallel.packing import MicroBatch, plan_micro_batches, plan_pair_micro_batches
from rl2gem.training.checkpoint import Checkpointer, atomic_write
from rl2gem.training.evaluation import evaluate_env
from rl2gem.training.forward import (
    packed_inputs,
    score_positions,
    sequence_ends,
    sequence_scores,
    sequence_sums,
    token_logprobs,
    token_values,
)
from rl2gem.training.metrics import Averager, measure_peak_flops, peak_flops_from_config, reduce_mean, train_flops
from rl2gem.training.offline import OfflineTrainer, check_data_config, epoch_batch
from rl2gem.training.online import OnlineTrainer
from rl2gem.training.pairs import PairSample, pair_sequences, tokenize_pairs
from rl2gem.training.reward_model import REWARD_MODES, RewardModel
from rl2gem.training.samples import Sample, apply_critic_estimator, samples_from_batch, subtract_kl_from_rewards
from rl2gem.training.settings import LoraSettings, WorkerSettings
from rl2gem.training.trainer import Trainer, launch
from rl2gem.training.worker import Worker, resolve_dtype, setup_distributed

__all__ = [
    "Averager",
    "LoraSettings",
    "Checkpointer",
    "MicroBatch",
    "OfflineTrainer",
    "OnlineTrainer",
    "PairSample",
    "Sample",
    "Worker",
    "WorkerSettings",
    "apply_critic_estimator",
    "atomic_write",
    "check_data_config",
    "epoch_batch",
    "evaluate_env",
    "measure_peak_flops",
    "packed_inputs",
    "pair_sequences",
    "plan_pair_micro_batches",
    "peak_flops_from_config",
    "plan_micro_batches",
    "reduce_mean",
    "resolve_dtype",
    "samples_from_batch",
    "Trainer",
    "launch",
    "sequence_ends",
    "score_positions",
    "sequence_scores",
    "sequence_sums",
    "setup_distributed",
    "subtract_kl_from_rewards",
    "RewardModel",
    "REWARD_MODES",
    "tokenize_pairs",
    "token_logprobs",
    "token_values",
    "train_flops",
]
