"""ZigZag layout (properties, in process) and the sequence/tensor-parallel kernels against
single-process references (under torchrun, 2 and 3 ranks, gloo)."""

import json

import pytest
import torch
from helpers import ROOT, torchrun

from rl2gem.parallel.ring_attention import zigzag_layout
from rl2gem.parallel.tensor_parallel import check_tp


@pytest.mark.parametrize("sp", [1, 2, 3])
def test_zigzag_layout_balances_ranks_and_round_trips(sp):
    lengths = [3, 1, 17, 40, 9]
    layout = zigzag_layout(lengths, sp)
    chunks = 2 * sp
    assert all(p % chunks == 0 and p >= n for p, n in zip(layout.padded_lengths, lengths, strict=True))
    assert layout.padded_lengths == [-(-n // chunks) * chunks for n in lengths]
    # every padded position is held by exactly one rank, and all ranks hold the same number
    assert sorted(layout.order.flatten().tolist()) == list(range(sum(layout.padded_lengths)))
    # rank r holds chunks r and 2*sp-1-r of each sequence, in that order
    start, expected = 0, [[] for _ in range(sp)]
    for padded in layout.padded_lengths:
        size = padded // chunks
        for r in range(sp):
            for c in (r, chunks - 1 - r):
                expected[r] += list(range(start + c * size, start + (c + 1) * size))
        start += padded
    assert layout.order.tolist() == expected
    # positions restart per sequence; padding sits after each sequence's real tokens
    packed = torch.arange(100, 100 + sum(lengths))
    padded = layout.pad(packed, fill=-1)
    assert padded[layout.source >= 0].tolist() == packed.tolist()
    assert (padded[layout.source < 0] == -1).all()
    real_positions = layout.positions[layout.source >= 0]
    assert real_positions.tolist() == [p for n in lengths for p in range(n)]
    stacked = torch.stack([layout.local(padded, r) for r in range(sp)])
    assert layout.unshard(stacked).tolist() == packed.tolist()


def test_zigzag_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="sp_size"):
        zigzag_layout([4], 0)
    with pytest.raises(ValueError, match="at least one token"):
        zigzag_layout([4, 0], 2)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_attention_and_vocab_parallel_logprobs_equal_one_process(tmp_path, ranks):
    """Forward and backward of ring attention (4 packings, incl. sequences shorter than 2*sp and
    of one token) against SDPA with a block-diagonal causal mask, and vocabulary-parallel
    log-probs/entropies against log_softmax, to fp32 rounding."""
    torchrun(ranks, str(ROOT / "tests" / "parallel" / "ring_and_vocab_check.py"), str(tmp_path / "out"))
    for rank in range(ranks):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        for packing in result["ring"]:
            assert max(packing.values()) < 1e-5, packing
        assert max(result["vocab"].values()) < 1e-5, result["vocab"]


def test_tensor_parallel_plan_errors_name_the_cause():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="no tensor-parallel plan for model_type='gpt2'"):
        check_tp(GPT2Config(), 2)
    smollm = LlamaConfig(
        num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536, vocab_size=49152
    )
    with pytest.raises(ValueError, match="actor.tp_size=2 does not divide the model's num_attention_heads=9"):
        check_tp(smollm, 2)
    check_tp(smollm, 3)
    check_tp(GPT2Config(), 1)


def test_gradient_checkpointing_recomputes_ring_attention_in_its_context(monkeypatch):
    """``actor.sp_size>1 actor.gradient_checkpointing=true``: a checkpointed layer is recomputed in
    the backward, outside the forward's ``ring_context`` (it raised there); the recompute enters
    the forward's layout again and the gradients equal those without checkpointing. One rank's
    group: the ring of one rank is the whole row."""
    import copy

    import torch
    import torch.distributed as dist
    from tiny import tiny_model

    from rl2gem.parallel.fsdp import _checkpointing
    from rl2gem.parallel.ring_attention import enable_ring_attention
    from rl2gem.procs import free_port
    from rl2gem.training import token_logprobs

    if dist.is_initialized():
        pytest.skip("a process group of this process exists")
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plain = tiny_model().float()
        checkpointed = copy.deepcopy(plain)
        for model in (plain, checkpointed):
            enable_ring_attention(model)
            model.rl2_sp_group = dist.group.WORLD
            model.train()
        checkpointed.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=_checkpointing(ring=True)
        )  # load_sharded's
        sequences = [[5, 6, 7, 8, 9], [10, 11, 12]]
        for model in (plain, checkpointed):
            token_logprobs(model, sequences, torch.device("cpu"))[0].sum().backward()
        for (name, want), have in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
            torch.testing.assert_close(have.grad, want.grad, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_blocks_meet_on_the_host_exactly_when_the_block_mask_allows_a_pair(sp):
    """Whether a ring step's block has any allowed pair is decided from the layout on the host
    (no device read per layer): equal to the brute-force mask's ``any()`` for every pair of ranks,
    and the mask built from the once-copied token vectors is the brute-force one."""
    from rl2gem.parallel.ring_attention import _block_mask

    generator = torch.Generator().manual_seed(sp)
    for lengths in ([1], [2, 1], [3, 1, 17, 40, 9], torch.randint(1, 30, (7,), generator=generator).tolist()):
        layout = zigzag_layout(lengths, sp)
        for rank in range(sp):
            for source in range(sp):
                sequence_q = layout.local(layout.sequence_ids, rank)
                position_q = layout.local(layout.positions, rank)
                sequence_k = layout.local(layout.sequence_ids, source)
                position_k = layout.local(layout.positions, source)
                brute = (sequence_q[:, None] == sequence_k[None, :]) & (position_k[None, :] <= position_q[:, None])
                assert layout.blocks_meet(rank, source) == bool(brute.any()), (lengths, rank, source)
                mask = _block_mask(layout, rank, source, torch.device("cpu"))
                assert (mask is None) == (not brute.any())
                if mask is not None:
                    assert torch.equal(mask, brute)


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"sliding_window": 64, "use_sliding_window": True}, "sliding-window attention"),
        ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
    ],
)
def test_ring_attention_refuses_what_it_would_compute_differently(extra, words):
    """Ring attention is full causal attention without a logit cap: a model that slides a window
    or caps its logits is refused when sequence parallelism switches it over, not trained wrong."""
    import transformers

    from rl2gem.parallel.ring_attention import enable_ring_attention

    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config.sliding_window = None
    for key, value in extra.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=f"actor.sp_size > 1: ring attention does not support {words}"):
        enable_ring_attention(transformers.MistralForCausalLM(config))
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config.sliding_window = None
    enable_ring_attention(transformers.MistralForCausalLM(config))  # full attention: accepted


def test_ring_attention_reads_the_layer_types_when_a_config_has_them():
    """Qwen2's window applies only to layers past ``max_window_layers``: a config whose layers are
    all full attention is accepted although ``use_sliding_window`` is set; one with a sliding
    layer is refused, naming the layer type."""
    import transformers

    from rl2gem.parallel.ring_attention import enable_ring_attention

    def qwen2(max_window_layers):
        config = transformers.Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers,
        )  # fmt: skip
        return transformers.Qwen2ForCausalLM(config)

    enable_ring_attention(qwen2(max_window_layers=2))
    with pytest.raises(ValueError, match=r"does not support layers of type \['sliding_attention'\]"):
        enable_ring_attention(qwen2(max_window_layers=1))
