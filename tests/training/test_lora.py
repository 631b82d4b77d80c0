"""LoRA workers (``actor.lora``) in one process (a 1-rank gloo group): they start as the base model,
train only the adapters, lower the loss, and their merged weights, Hugging Face export and peft
adapter export all reproduce the trained model's log-probs (peft's own ``PeftModel`` is the
reference for the adapter)."""

import asyncio

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from rl2gem.rollout.engines.embedded import EmbeddedEngine
from rl2gem.training import Checkpointer, Worker, setup_distributed, token_logprobs
from rl2gem.training.lora import adapter_state_dict, lora_config, merged_state_dict

BATCH = [[5, 6, 7, 8, 9, 10, 11, 12], [9, 10, 11, 40, 41]]
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear", "rslora": False}


@pytest.fixture(scope="module")
def group():
    rank, world, device, mesh = setup_distributed(0, {})
    yield device, mesh
    dist.destroy_process_group()


def logprobs_of(model, device="cpu"):
    with torch.no_grad():
        return token_logprobs(model, BATCH, torch.device(device))[0]


def train(worker, device, steps):
    losses = []
    for _ in range(steps):
        logprobs, _ = token_logprobs(worker.model, BATCH, device)
        loss = -logprobs.mean()
        loss.backward()
        worker.step()
        losses.append(loss.item())
    return losses


def test_lora_config_reads_the_section_and_rejects_bad_values():
    assert lora_config(None) is None and lora_config({"rank": 0}) is None
    config = lora_config(LORA)
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8.0, "all-linear")
    assert lora_config({"rank": 2, "target_modules": ["q_proj", "v_proj"]}).target_modules == {"q_proj", "v_proj"}
    for bad, message in [
        ({"rank": 4, "rnak": 2}, "unknown keys"),
        ({"rank": -1}, "rank must be >= 0"),
        ({"rank": 4, "alpha": 0}, "alpha must be > 0"),
        ({"rank": 4, "dropout": 1.0}, "dropout"),
        ({"rank": 4, "target_modules": []}, "target_modules is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            lora_config(bad)


def test_a_lora_worker_starts_as_the_base_trains_only_adapters_and_lowers_the_loss(group, tiny_dir):
    device, mesh = group
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    worker = Worker({"model": str(tiny_dir), "lr": 1e-2, "lora": LORA}, mesh, device, total_steps=10)
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of the 2 blocks (q, k, v, o, gate, up, down) has an A and a B; the LM head has none
    assert len(trainable) == 2 * 7 * 2
    assert sum(p.numel() for group_ in worker.optimizer.param_groups for p in group_["params"]) == (
        worker.num_trainable_parameters
    )
    assert worker.num_parameters == sum(p.numel() for p in base.parameters())
    torch.testing.assert_close(logprobs_of(worker.model), logprobs_of(base), rtol=0, atol=1e-5)  # B = 0 at start
    # a frozen worker built from the same section is the base model (a reference policy)
    frozen = Worker({"model": str(tiny_dir), "lora": LORA}, mesh, device, trainable=False)
    assert frozen.lora is None and not any(".lora_" in n for n, _ in frozen.model.named_parameters())

    before = worker.full_state_dict(merged=False)
    losses = train(worker, device, 8)
    assert losses[-1] < 0.9 * losses[0], losses
    after = worker.full_state_dict(merged=False)
    for name, tensor in after.items():
        if ".lora_" not in name:
            assert torch.equal(tensor, before[name]), f"frozen {name} moved"
    assert any(not torch.equal(after[n], before[n]) for n in after if ".lora_B." in n)


def test_merged_weights_export_and_adapter_reproduce_the_trained_model(group, tiny_dir, tmp_path):
    device, mesh = group
    worker = Worker({"model": str(tiny_dir), "lr": 1e-2, "lora": LORA}, mesh, device, total_steps=10)
    train(worker, device, 3)
    trained = logprobs_of(worker.model)

    # merged weights: loaded into a plain model, they give the LoRA model's log-probs
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    plain.load_state_dict(worker.full_state_dict(), strict=True)
    torch.testing.assert_close(logprobs_of(plain), trained, rtol=0, atol=1e-4)

    # the Hugging Face export is the merged model; <hf>/adapter is peft's format, loaded by peft itself
    folder = worker.export_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(logprobs_of(exported), trained, rtol=0, atol=1e-4)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), folder / "adapter").eval()
    torch.testing.assert_close(logprobs_of(with_adapter), trained, rtol=0, atol=1e-4)
    # peft's own merge (merge_and_unload) gives the same weights as ours
    theirs = with_adapter.merge_and_unload().state_dict()
    ours = worker.full_state_dict()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6)

    # after a weight sync the embedded engine's log-probs equal the trainer's
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(tiny_dir), None, seed=0)

    async def sync_and_score():
        await engine.update_weights(worker.full_state_dict(), version=1)
        out = await engine.generate(BATCH[0], {"max_new_tokens": 1}, logprob_start_len=1)
        await engine.close()
        return out

    out = asyncio.run(sync_and_score())
    first = trained[1 : len(BATCH[0])]  # token_logprobs puts 0 at each sequence's first token
    torch.testing.assert_close(torch.tensor(out.input_logprobs), first, rtol=0, atol=1e-4)


def test_lora_checkpoints_resume_the_adapters_and_their_optimizer(group, tiny_dir, tmp_path):
    device, mesh = group
    worker = Worker({"model": str(tiny_dir), "lr": 1e-2, "lora": LORA}, mesh, device, total_steps=10)
    train(worker, device, 2)
    checkpointer = Checkpointer(tmp_path, {"actor": worker})
    checkpointer.save(2)
    saved = worker.full_state_dict(merged=False)
    next_loss = train(worker, device, 1)[0]
    checkpointer.load()
    for name, tensor in worker.full_state_dict(merged=False).items():
        assert torch.equal(tensor, saved[name]), name
    assert train(worker, device, 1)[0] == pytest.approx(next_loss, rel=1e-6)


def test_merge_by_hand():
    """W + (alpha / r) B A on one layer, and rsLoRA's alpha / sqrt(r)."""
    w, a, b = torch.randn(3, 5), torch.randn(2, 5), torch.randn(3, 2)
    state = {
        "layer.q_proj.base_layer.weight": w,
        "layer.q_proj.lora_A.default.weight": a,
        "layer.q_proj.lora_B.default.weight": b,
        "layer.q_proj.base_layer.bias": torch.ones(3),
        "norm.weight": torch.ones(5),
    }
    merged = merged_state_dict(state, LoraConfig(r=2, lora_alpha=8))
    assert set(merged) == {"layer.q_proj.weight", "layer.q_proj.bias", "norm.weight"}
    torch.testing.assert_close(merged["layer.q_proj.weight"], w + 4.0 * b @ a)
    rs = merged_state_dict(state, LoraConfig(r=2, lora_alpha=8, use_rslora=True))
    torch.testing.assert_close(rs["layer.q_proj.weight"], w + 8.0 / 2**0.5 * b @ a)
    # a GPU's weight sync merges where the weights are: no tensor goes through host memory (on the
    # meta device a copy to the CPU raises)
    on_meta = merged_state_dict({name: t.to("meta") for name, t in state.items()}, LoraConfig(r=2, lora_alpha=8))
    assert {t.device.type for t in on_meta.values()} == {"meta"}
    assert adapter_state_dict(state)["base_model.model.layer.q_proj.lora_A.weight"].device.type == "cpu"


def test_lora_on_an_embedding_is_refused_and_foreign_adapters_the_merge_cannot_apply_are_refused(
    group, tiny_dir, tmp_path
):
    """An embedding's adapter (peft's lora_embedding_A/B) was trained but never merged: the engine
    and the export ran the base embeddings (log-probs 4.2 nats away). Per-module ranks or scales
    and DoRA were merged with one global scale and no magnitude (2-13 nats away from peft's)."""
    from rl2gem.training.lora import load_adapter

    device, mesh = group
    with pytest.raises(ValueError, match=r"linear layers only, not the embedding\(s\) \['model.embed_tokens'\]"):
        Worker({"model": str(tiny_dir), "lora": {**LORA, "target_modules": ["q_proj", "embed_tokens"]}}, mesh, device)
    for name, extra in (("pattern", {"alpha_pattern": {"q_proj": 32}}), ("dora", {"use_dora": True})):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
        model = PeftModel(AutoModelForCausalLM.from_pretrained(tiny_dir), config)
        model.save_pretrained(tmp_path / name)
        with pytest.raises(ValueError, match="which the merge here does not apply"):
            load_adapter(tmp_path / name)
    plain = PeftModel(AutoModelForCausalLM.from_pretrained(tiny_dir), LoraConfig(r=4, target_modules=["q_proj"]))
    plain.save_pretrained(tmp_path / "plain")
    assert load_adapter(tmp_path / "plain")[0].r == 4


def test_the_export_keeps_the_models_generation_settings_and_its_kv_cache(group, tiny_dir, tmp_path):
    """The export wrote a generation config made from config.json (an instruct model's end-of-turn
    ids and sampling defaults lost: the engine stopped on other tokens) and use_cache=false from
    training (Hugging Face generate ran 40x slower)."""
    import shutil

    from transformers import GenerationConfig

    device, mesh = group
    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    GenerationConfig(eos_token_id=[2, 0], do_sample=True, temperature=0.7, top_p=0.8).save_pretrained(base)
    folder = Worker({"model": str(base)}, mesh, device).export_hf(tmp_path / "hf")
    exported = GenerationConfig.from_pretrained(folder)
    assert (exported.eos_token_id, exported.temperature, exported.top_p) == ([2, 0], 0.7, 0.8)
    assert AutoModelForCausalLM.from_pretrained(folder).config.use_cache is True
