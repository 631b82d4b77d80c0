"""Loss weighting: one implementation behind ``aggregate`` and the trainers' global-batch token weights."""

import pytest
import torch

from rl2gem.algorithms import LOSS_AGGREGATIONS, aggregate, loss_weights, packed_loss_weights


def test_hand_computed_weights():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    assert loss_weights(mask, "token_mean").tolist() == [[0, 0.25, 0.25, 0.25], [0, 0, 0.25, 0]]
    assert loss_weights(mask, "seq_mean_token_sum").tolist() == [[0, 0.5, 0.5, 0.5], [0, 0, 0.5, 0]]
    assert loss_weights(mask, "seq_mean_token_mean")[0, 1].item() == pytest.approx(1 / 6)
    assert loss_weights(mask, "seq_mean_token_mean")[1, 2].item() == pytest.approx(1 / 2)
    assert loss_weights(mask, "seq_mean_token_sum_norm", norm=8)[0, 1].item() == pytest.approx(1 / 16)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_micro_batch_token_weights_sum_to_the_whole_batch_aggregate(mode):
    """Split a batch into micro-batches (one packed row each) with the global totals: the sum of
    the micro-batch losses equals ``aggregate`` over the padded whole batch."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 7, 12, 4]
    masks = [[0, 0] + torch.randint(0, 2, (n - 2,), generator=g).tolist() for n in lengths]
    masks[2] = [0] * 3  # a sequence without action tokens still counts as a sequence
    losses = [torch.randn(n, generator=g) for n in lengths]
    width = max(lengths)
    padded_loss, padded_mask = torch.zeros(len(lengths), width), torch.zeros(len(lengths), width)
    for i, (loss, m) in enumerate(zip(losses, masks, strict=True)):
        padded_loss[i, : len(loss)], padded_mask[i, : len(m)] = loss, torch.tensor(m, dtype=torch.float32)
    expected = aggregate(padded_loss, padded_mask, mode, norm=16.0).item()
    totals = {"num_tokens": float(padded_mask.sum()), "num_sequences": float(len(lengths))}
    total = 0.0
    for micro in ([0, 3], [1], [2, 4, 5]):
        w = packed_loss_weights([masks[i] for i in micro], mode, 16.0, **totals)
        total += float((torch.cat([losses[i] for i in micro]) * w).sum())
    assert total == pytest.approx(expected, rel=1e-5)


def test_aggregate_is_the_weighted_sum_and_errors_are_clear():
    loss, mask = torch.randn(3, 5), torch.randint(0, 2, (3, 5))
    for mode in LOSS_AGGREGATIONS:
        assert aggregate(loss, mask, mode).item() == pytest.approx(float((loss * loss_weights(mask, mode)).sum()))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss_weights(mask, "sum")
    with pytest.raises(ValueError, match="needs norm"):
        packed_loss_weights([[1, 1]], "seq_mean_token_sum_norm", num_tokens=2, num_sequences=1)
