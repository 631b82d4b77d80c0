"""Preference pairs as training items: response-only masks, pairs never split over micro-batches,
per-sequence sums and the score positions of a sequence classifier."""

import pytest
import torch
from helpers import masked_runs
from transformers import AutoTokenizer

from rl2gem.data import PreferencePair
from rl2gem.models import resolve_model
from rl2gem.parallel.packing import plan_pair_micro_batches
from rl2gem.rollout.tito import ChatRenderer
from rl2gem.training.forward import score_positions, sequence_sums
from rl2gem.training.pairs import pair_sequences, tokenize_pairs


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")))


def test_only_the_response_carries_the_mask(renderer):
    """An earlier assistant turn of the prompt is context; the response and its end-of-turn token
    are the masked tokens of each side."""
    prompt = [
        {"role": "user", "content": "Guess a number from 1 to 4."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Higher."},
    ]
    pair = PreferencePair(prompt, [{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "1"}])
    (item,) = tokenize_pairs(renderer, [pair], 1024)
    decode = renderer.tokenizer.decode
    assert [decode(r) for r in masked_runs(item.chosen.ids, item.chosen.mask)] == ["3<|im_end|>"]
    assert [decode(r) for r in masked_runs(item.rejected.ids, item.rejected.mask)] == ["1<|im_end|>"]
    assert decode(item.chosen.ids).count("<|im_start|>assistant\n2<|im_end|>") == 1  # the earlier turn is there
    assert len(item) == len(item.chosen) + len(item.rejected)
    assert item.ref_chosen_logps is None


def test_a_pair_cut_to_no_response_is_dropped_and_data_references_are_kept(renderer):
    long = PreferencePair([{"role": "user", "content": "word " * 50}], [{"role": "assistant", "content": "a"}] * 1,
                          [{"role": "assistant", "content": "b"}])  # fmt: skip
    given = PreferencePair(
        [{"role": "user", "content": "hi"}],
        [{"role": "assistant", "content": "hello"}],
        [{"role": "assistant", "content": "go"}],
        {"ref_chosen_logps": -1.5, "ref_rejected_logps": -4},
    )
    (full,) = tokenize_pairs(renderer, [given], 1024)
    limit = max(len(full.chosen), len(full.rejected))  # the given pair fits, the long prompt does not
    with pytest.warns(UserWarning, match=rf"data.max_length={limit}: 1 of 2 pairs cut to it .*, 1 dropped"):
        items = tokenize_pairs(renderer, [long, given], limit)
    assert len(items) == 1 and (items[0].ref_chosen_logps, items[0].ref_rejected_logps) == (-1.5, -4.0)
    cut = PreferencePair(given.prompt, [{"role": "assistant", "content": "hello " * 40}], given.rejected)
    with pytest.warns(UserWarning, match=r"1 of 1 pairs cut to it \(their end not trained on\), 0 dropped"):
        assert len(tokenize_pairs(renderer, [cut], limit + 5)) == 1  # kept, its response's end cut
    # a cut pair's data references sum the whole response, the policy's only the kept tokens: dropped
    cut = PreferencePair(cut.prompt, cut.chosen, cut.rejected, dict(given.extra))
    with pytest.warns(UserWarning, match="1 cut pairs carry reference log-probs of their whole responses"):
        (item,) = tokenize_pairs(renderer, [cut], limit + 5)
    assert item.ref_chosen_logps is None and item.ref_rejected_logps is None


def test_pairs_are_planned_whole_and_packed_chosen_then_rejected(renderer):
    pairs = [
        PreferencePair(
            [{"role": "user", "content": f"question {i} " * (i + 1)}],
            [{"role": "assistant", "content": "yes " * (i % 3 + 1)}],
            [{"role": "assistant", "content": "no"}],
        )
        for i in range(7)
    ]
    items = tokenize_pairs(renderer, pairs, 1024)
    seen = []
    for rank in range(2):
        for mb in plan_pair_micro_batches([(p.chosen.ids, p.rejected.ids) for p in items], rank, 2, max_tokens=60):
            assert mb.placeholder or sum(len(items[i]) for i in mb.indices) <= max(60, max(map(len, items)))
            if not mb.placeholder:
                seen += mb.indices
    assert sorted(seen) == list(range(7))  # every pair exactly once, both sides together
    packed = pair_sequences(items[:2])
    assert packed == [items[0].chosen, items[0].rejected, items[1].chosen, items[1].rejected]


def test_sequence_sums_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    sums = sequence_sums(values, [2, 4], [[0, 1], [1, 0, 1, 1]])
    assert sums.tolist() == [2.0, 3.0 + 5.0 + 6.0]
    sums.sum().backward()
    assert values.grad.tolist() == [0, 1, 1, 0, 1, 1]


def test_score_positions_skip_trailing_padding_like_transformers():
    assert score_positions([[5, 6, 2], [7, 2, 2], [2, 2]], pad_token_id=2) == [1, 3, 6]  # all padding: the first token
    assert score_positions([[5, 6, 2], [7]]) == score_positions([[5, 6, 2], [7]], pad_token_id=None) == [2, 3]
