"""Preference pairs as training items: tokenised chosen / rejected sequences that share a prompt,
planned so that a pair's two sequences are always in the same packed micro-batch (reward models
and DPO compare them; RL2 packs them the same way, so a pair costs up to ``2 * max_length``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from rl2gem.data import PreferencePair
from rl2gem.rollout.tito import ChatRenderer
from rl2gem.training.samples import Sample, warn_cut

__all__ = ["PairSample", "tokenize_pairs", "pair_sequences"]


@dataclasses.dataclass
class PairSample:
    """One tokenised preference pair.

    Attributes:
        chosen, rejected: :class:`~rl2gem.training.Sample` s whose ``mask`` is 1 on the response's
            assistant tokens only (the prompt's earlier assistant turns, if any, are 0).
        ref_chosen_logps, ref_rejected_logps: reference sequence log-probs given by the data
            (DPO), or None.
    """

    chosen: Sample
    rejected: Sample
    ref_chosen_logps: float | None = None
    ref_rejected_logps: float | None = None

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def _response_sample(
    renderer: ChatRenderer, pair: PreferencePair, side: str, max_length: int
) -> tuple[Sample | None, bool]:
    """One side of ``pair`` as a sample (None: no response token within ``max_length``), and
    whether it was cut."""
    messages = pair.prompt + getattr(pair, side)
    sequence = renderer.conversation(messages)
    ids, mask = list(sequence.input_ids[:max_length]), list(sequence.action_mask[:max_length])
    stop = 1  # each assistant turn is its encoded content and the stop token (ChatRenderer.conversation)
    skip = sum(len(renderer.encode(m["content"])) + stop for m in pair.prompt if m["role"] == "assistant")
    for position, on in enumerate(mask):
        if skip == 0:
            break
        if on:
            mask[position], skip = 0, skip - 1
    return (Sample(ids, mask) if any(mask) else None), len(sequence.input_ids) > max_length


def tokenize_pairs(renderer: ChatRenderer, pairs: Sequence[PreferencePair], max_length: int) -> list[PairSample]:
    """One :class:`PairSample` per pair, each side rendered as a rollout would tokenise it
    (:meth:`~rl2gem.rollout.tito.ChatRenderer.conversation`) and cut to ``max_length`` tokens.
    Pairs where either side keeps no response token after the cut are dropped. Reference
    log-probs are taken from ``extra["ref_chosen_logps"]`` / ``extra["ref_rejected_logps"]``
    when both are present, except for a cut pair: the data's sum covers the whole response and
    the policy's only the kept tokens, so that pair gets none (DPO then computes every pair's
    with the reference model, one source for all)."""
    out, cut, unmatched = [], 0, 0
    for pair in pairs:
        (chosen, chosen_cut), (rejected, rejected_cut) = (
            _response_sample(renderer, pair, side, max_length) for side in ("chosen", "rejected")
        )
        cut += chosen_cut or rejected_cut
        if chosen is None or rejected is None:
            continue
        refs = (pair.extra.get("ref_chosen_logps"), pair.extra.get("ref_rejected_logps"))
        refs = tuple(float(r) for r in refs) if None not in refs else (None, None)
        if (chosen_cut or rejected_cut) and None not in refs:
            refs, unmatched = (None, None), unmatched + 1
        out.append(PairSample(chosen, rejected, *refs))
    warn_cut("pairs", len(pairs), cut, len(pairs) - len(out), max_length)
    if unmatched:
        warnings.warn(
            f"data.max_length={max_length}: {unmatched} cut pairs carry reference log-probs of their whole "
            "responses, which no longer match; the reference model computes every pair's instead",
            stacklevel=2,
        )
    return out


def pair_sequences(pairs: Sequence[PairSample]) -> list[Sample]:
    """The samples of ``pairs`` in packing order: ``chosen_0, rejected_0, chosen_1, ...``."""
    return [sample for pair in pairs for sample in (pair.chosen, pair.rejected)]
