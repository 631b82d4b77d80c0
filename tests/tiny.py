"""Tiny models built from config (random weights) for fast engine and trainer tests."""

import torch


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits so sampling tests see a non-uniform distribution
        model.model.embed_tokens.weight.mul_(40.0)
    return model


def tiny_family_model(kind: str, **extra):
    """A random model of ``kind`` (a family, or ``llama-linear`` / ``llama-dynamic``: Llama with
    that rotary scaling)."""
    import transformers

    if kind.startswith("llama-"):
        rope = {"rope_type": kind.split("-")[1], "factor": 4.0, "rope_theta": 10000.0}
        return tiny_family_model("llama", rope_parameters=rope, **extra)

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v biases
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),  # per-head q/k RMSNorm
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    if kind == "mistral":
        common["sliding_window"] = None
    if kind == "qwen3":
        common["head_dim"] = 16
    common.update(extra)
    torch.manual_seed(0)
    model = model_class(config_class(**common)).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from their 0/1 init, so they matter
            p.add_(0.05 * torch.randn_like(p))
    return model
