"""A trained reward model as a reward: scores token sequences, conversations and rollout episodes.

``trainers/rm.py`` exports a folder that ``AutoModelForSequenceClassification`` loads (one label,
the score read at the last non-padding token). :class:`RewardModel` runs it on packed rows, as
training did, so it gives the training scores; PPO uses it through ``reward.model=PATH`` for envs
without a verifiable reward (``reward.mode=replace``) or to shape one (``add``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rl2gem.models import resolve_model
from rl2gem.parallel.attention import enable_attention, resolve_attention
from rl2gem.parallel.fsdp import float32_head
from rl2gem.rewards.objectives import set_final_reward
from rl2gem.rollout.tito import ChatRenderer, load_chat_template
from rl2gem.training.forward import sequence_scores

__all__ = ["REWARD_MODES", "RewardModel", "reward_model_folder", "reward_model_problem"]

#: How :meth:`RewardModel.apply` combines the model's score with the env's reward.
REWARD_MODES = ("replace", "add")


def reward_model_folder(path: str) -> str:
    """The model folder of ``path``: a ``trainers/rm.py`` run folder's latest checkpoint's ``hf/``,
    else ``path`` itself."""
    run = Path(path)
    if (run / "latest").is_file():  # a trainer's output folder
        return str(run / (run / "latest").read_text().strip() / "hf")
    return path


def reward_model_problem(path: str) -> str | None:
    """Why the model folder of ``path`` (:func:`reward_model_folder`) is not a reward model, read
    from its ``config.json`` without loading it (a one-label ``*ForSequenceClassification``), or
    None (also when there is no such file to read: the load says what is wrong then)."""
    config = Path(reward_model_folder(path)) / "config.json"
    if not config.is_file():
        return None
    settings = json.loads(config.read_text())
    architectures = settings.get("architectures") or []
    labels = len(settings.get("id2label") or {0: None})
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        return (
            f"{path} is a {architectures[0]}, not a reward model (a one-label sequence classifier, such as a "
            "trainers/rm.py run folder)"
        )
    if labels != 1:
        return f"{path}: a reward model has one label, this one has {labels}"
    return None


class RewardModel:
    """A sequence-classifier reward model (one label) on one device, for scoring.

    It attends as the trainers do (``actor.attention=auto``: flash-attn or FlexAttention over a
    packed row on CUDA, block attention on the CPU; no ``[N, N]`` mask), and its one-label head
    computes in float32 whatever ``dtype`` (a bf16 score keeps 8 significant bits: 2 to 4 moves in
    steps of 1/64, which ties close scores of a group).

    Args:
        path: a ``trainers/rm.py`` run folder (its latest checkpoint's ``hf/`` is used), a
            ``checkpoint-<step>/hf`` folder, or any one-label sequence classifier transformers loads.
        device: where it runs (``"cpu"``, ``"cuda:0"``).
        dtype: its parameters' dtype (float32 on CPU; the head's is float32).
        max_tokens: tokens per packed forward (a longer sequence runs alone).
        chat_template: renders conversations for :meth:`score_conversations` (a built-in name,
            Jinja file or text; default the tokenizer's), as ``rollout.chat_template`` does.

    Raises:
        ValueError: the model does not have exactly one label, or no one-label ``score`` head.
    """

    def __init__(
        self,
        path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_tokens: int = 4096,
        chat_template: str | None = None,
    ):
        path = reward_model_folder(path)
        folder = resolve_model(path)
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has one label, this one has {self.model.config.num_labels}")
        enable_attention(self.model, resolve_attention("auto", self.device, dtype=dtype))
        head = getattr(self.model, "score", None)
        if getattr(head, "out_features", None) != 1:
            raise ValueError(f"{path}: {type(self.model).__name__} has no one-label score head (a reward model)")
        if head.weight.dtype != torch.float32:  # the score in float32, from the hidden states
            float32_head(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        # transformers' pooling: the last token that is not padding (the trainer's last token for an
        # export of this version; the token before the end of a turn for a model that pads with it)
        self.pad_token_id = self.model.config.pad_token_id
        ends = self.model.config.eos_token_id
        ends = {*(ends if isinstance(ends, (list, tuple)) else [ends]), self.tokenizer.eos_token_id}
        if self.pad_token_id is not None and self.pad_token_id in ends:
            warnings.warn(
                f"{path} pads with an end-of-text token ({self.pad_token_id}): its scores are read before a reply's "
                "end-of-turn token, so a reply cut off there scores as a finished one (an export of trainers/rm.py "
                "from before 2026-11-29, or a model trained with pad = eos; re-exporting does not change what it learned)",
                stacklevel=2,
            )
        self.renderer = ChatRenderer(self.tokenizer, load_chat_template(chat_template))
        self.max_tokens = int(max_tokens)

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (packed ``max_tokens`` at a time, in order)."""
        scores: list[float] = []
        chunk: list[Sequence[int]] = []
        tokens = 0
        for ids in [*sequences, None]:
            if chunk and (ids is None or tokens + len(ids) > self.max_tokens):
                scores += sequence_scores(self.model, chunk, self.device, self.pad_token_id).tolist()
                chunk, tokens = [], 0
            if ids is not None:
                chunk.append(ids)
                tokens += len(ids)
        return scores

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ``ValueError`` unless ``tokenizer`` (the policy's, whose token ids :meth:`apply`
        scores) has this model's vocabulary: other ids would be scored as other tokens, or (an id
        past the embedding) fail on the device."""
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                "reward.model: its tokenizer's vocabulary differs from the actor's, whose token ids it would score; "
                "train the reward model from the actor's base model"
            )

    def score_conversations(self, conversations: Sequence[list[dict[str, Any]]]) -> list[float]:
        """One score per conversation (``{"role", "content"}`` messages ending with the response),
        tokenised as rollouts and ``trainers/rm.py`` do
        (:meth:`~rl2gem.rollout.tito.ChatRenderer.conversation`)."""
        return self.score_ids([self.renderer.conversation(list(m)).input_ids for m in conversations])

    def apply(self, batch, mode: str = "replace") -> dict[str, float]:
        """Score every finished episode of a rollout batch (:class:`rl2gem.rollout.RolloutBatch`)
        on its last sequence's tokens and put the score into its reward, in place:
        ``replace`` makes it the episode's only reward, ``add`` adds it to the env's. The score
        goes on the last turn (``turn_rewards``) and the last action token (``Sequence.rewards``),
        where the env's final reward is; ``info["rm_score"]`` keeps it.

        Returns:
            ``{"rollout/rm_score": mean score}`` (0 for an empty batch).

        Raises:
            ValueError: unknown ``mode``.
        """
        if mode not in REWARD_MODES:
            raise ValueError(f"reward mode must be one of {REWARD_MODES}, got {mode!r}")
        episodes = [e for e in batch.episodes if e.sequences and e.turn_rewards]
        scores = self.score_ids([e.sequences[-1].input_ids for e in episodes])
        for episode, score in zip(episodes, scores, strict=True):
            set_final_reward(episode, score, mode)
            episode.info = {**episode.info, "rm_score": score}
        return {"rollout/rm_score": sum(scores) / len(scores) if scores else 0.0}
