"""Workers, the mesh and the Checkpointer in one process (a 1-rank gloo group)."""

import json

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rl2gem.parallel.mesh import build_mesh
from rl2gem.training import Checkpointer, Worker, setup_distributed, token_logprobs


@pytest.fixture(scope="module")
def group():
    rank, world, device, mesh = setup_distributed(0, {})
    yield device, mesh
    dist.destroy_process_group()


def train_once(worker, device):
    logprobs, _ = token_logprobs(worker.model, [[5, 6, 7, 8], [9, 10, 11]], device)
    (-logprobs.sum()).backward()
    return worker.step()


def test_mesh_dims_and_errors(group):
    _, mesh = group
    assert mesh.sizes == {"replicate": 1, "shard": 1, "sp": 1, "tp": 1}
    assert (mesh.dp_rank, mesh.dp_size) == (0, 1)
    with pytest.raises(ValueError, match="actor.ddp_size"):
        build_mesh(ddp_size=2)
    with pytest.raises(ValueError, match=r"actor.ddp_size \* actor.sp_size \* actor.tp_size = 1 \* 1 \* 2"):
        build_mesh(tp_size=2)
    with pytest.raises(ValueError, match="actor.sp_size=0 must be >= 1"):
        build_mesh(sp_size=0)
    assert mesh.micro_batch_tokens(100) == 100


def test_save_then_load_restores_weights_optimizer_scheduler_and_rng(group, tiny_dir, tmp_path):
    device, mesh = group
    section = {"model": str(tiny_dir), "lr": 1e-2, "warmup_steps": 3}
    worker = Worker(section, mesh, device, total_steps=10)
    assert worker.num_parameters == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_dir).parameters())
    train_once(worker, device)
    checkpointer = Checkpointer(tmp_path, {"actor": worker})
    path = checkpointer.save(
        1, trainer_state={"position": 7}, rank_state={"note": "mine"}, export=lambda p: worker.export_hf(p)
    )
    assert checkpointer.latest() == path and (tmp_path / "latest").read_text() == "checkpoint-1"
    saved = worker.full_state_dict()
    lr, rng = worker.lr, torch.rand(3)
    next_norm = train_once(worker, device)  # moves weights, Adam moments and the scheduler
    meta, local = checkpointer.load()
    assert meta["step"] == 1 and meta["position"] == 7 and local["note"] == "mine"
    assert worker.lr == lr
    for name, t in worker.full_state_dict().items():
        assert torch.equal(t, saved[name]), name
    assert torch.equal(torch.rand(3), rng)  # the RNG is back where it was at the save
    assert train_once(worker, device) == pytest.approx(next_norm, rel=1e-6)  # the same step again
    exported = AutoModelForCausalLM.from_pretrained(path / "hf")
    for name, t in exported.state_dict().items():
        assert torch.equal(t, saved[name]), name
    assert json.loads((path / "trainer_state.json").read_text())["world_size"] == 1


def test_a_checkpoint_of_another_world_size_is_refused_on_every_rank(group, tiny_dir, tmp_path):
    device, mesh = group
    worker = Worker({"model": str(tiny_dir)}, mesh, device, trainable=False)
    assert worker.optimizer is None and not worker.model.training
    checkpointer = Checkpointer(tmp_path, {"ref": worker})
    assert checkpointer.load() is None
    path = checkpointer.save(3)
    meta = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps(meta | {"world_size": 2}))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\), this run has 1: resume with 2"):
        checkpointer.load()  # every rank says so, rank 0 too (its own file is there)
    (path / "trainer_state.json").write_text(json.dumps(meta))
    (path / "rank0.pkl").unlink()
    with pytest.raises(FileNotFoundError, match="world size"):
        checkpointer.load()


def test_prune_keeps_the_newest_resumable_checkpoints_and_every_export(tmp_path):
    for step in (5, 10, 15, 20, 30):
        for part in ("dcp", "hf"):
            (tmp_path / f"checkpoint-{step}" / part).mkdir(parents=True)
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-notes").mkdir()  # not a checkpoint: left alone
    (tmp_path / "checkpoint-3" / "dcp").mkdir(parents=True)  # a save killed before its state: left alone
    assert Checkpointer(tmp_path, {}, keep=2).prune() == []  # no latest yet: nothing is known to be older
    (tmp_path / "latest").write_text("checkpoint-20")  # checkpoint-30 is another run's, past latest
    assert Checkpointer(tmp_path, {}, keep=0).prune() == []
    pruned = Checkpointer(tmp_path, {}, keep=2).prune()
    assert pruned == [tmp_path / "checkpoint-5", tmp_path / "checkpoint-10"]  # by step, not by name
    assert sorted(p.parent.name for p in tmp_path.glob("*/dcp")) == [f"checkpoint-{s}" for s in (15, 20, 3, 30)]
    assert len(list(tmp_path.glob("checkpoint-*/hf"))) == 5
    (tmp_path / "latest").write_text("checkpoint-15")  # a new run's checkpoint of a lower step
    assert Checkpointer(tmp_path, {}, keep=1).prune() == []  # latest's own dcp stays: it is the newest kept
    with pytest.raises(ValueError, match="keep must be >= 0"):
        Checkpointer(tmp_path, {}, keep=-1)


def test_the_checkpoint_latest_names_is_never_written_again(group, tiny_dir, tmp_path):
    """A run whose last step is a periodic save step saved it twice, in place, under ``latest``: a
    kill during the second save (dcp empties its files first) left no checkpoint that loads. A
    folder of the step being saved that ``latest`` does not name is another run's and is replaced."""
    device, mesh = group
    worker = Worker({"model": str(tiny_dir), "lr": 1e-2}, mesh, device, total_steps=10)
    checkpointer = Checkpointer(tmp_path, {"actor": worker})
    path = checkpointer.save(2, trainer_state={"trainer": "sft"})
    files = {f: f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()}
    train_once(worker, device)
    assert checkpointer.save(2, trainer_state={"trainer": "sft"}) == path
    assert {f: f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()} == files  # untouched
    # the run's final save of a step saved already (save_every divides total_steps): only the end is noted
    assert checkpointer.save(2, trainer_state={"trainer": "sft", "finished": True}) == path
    assert json.loads((path / "trainer_state.json").read_text())["finished"] is True
    assert {f for f in files if f.stat().st_mtime_ns != files[f]} == {path / "trainer_state.json"}
    stale = tmp_path / "checkpoint-3"
    (stale / "dcp").mkdir(parents=True)
    (stale / "rank5.pkl").write_bytes(b"another run's")
    checkpointer.save(3, trainer_state={"trainer": "sft"})
    assert not (stale / "rank5.pkl").exists() and (tmp_path / "latest").read_text() == "checkpoint-3"
    with pytest.raises(ValueError, match="written with trainer='sft', this run has trainer='dpo'"):
        checkpointer.load(expected={"trainer": "dpo"})  # before anything loads
    assert checkpointer.load(expected={"trainer": "sft"})[0]["step"] == 3


def _full_float32(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a parameter or gradient (the whole tensor of an FSDP DTensor)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


def _one_update(worker, device):
    """The worker's parameters before and after one AdamW step, and the gradients, as float32."""
    before = {n: _full_float32(p) for n, p in worker.model.named_parameters()}
    logprobs, _ = token_logprobs(worker.model, [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12]], device)
    (-logprobs.sum()).backward()
    grads = {n: _full_float32(p.grad) for n, p in worker.model.named_parameters() if p.grad is not None}
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    return before, {n: _full_float32(p) for n, p in worker.model.named_parameters()}, grads


def test_bfloat16_training_keeps_float32_master_weights(group, tiny_dir, tmp_path):
    """AdamW's first step moves each weight by ``lr`` (``m / sqrt(v)`` is the gradient's sign). At
    lr 1e-5 that is below bfloat16's resolution at the tiny model's weights (std 0.02: about 1e-4),
    so pure bfloat16 weights (``master_dtype=bfloat16``) mostly keep their values; the default keeps
    float32 master weights (FSDP2 mixed precision, also at one rank): every weight with a gradient
    moves by ``lr``. A frozen worker stays in bfloat16; the export is in the compute dtype."""
    device, mesh = group
    section = {"model": str(tiny_dir), "dtype": "bfloat16", "lr": 1e-5, "max_grad_norm": 0.0}
    mixed = Worker(section, mesh, device)
    pure = Worker({**section, "master_dtype": "bfloat16"}, mesh, device)
    frozen = Worker(section, mesh, device, trainable=False)
    assert (mixed.dtype, mixed.master_dtype, pure.master_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert (
        {p.dtype for p in pure.model.parameters()} == {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
    )
    for worker, moved_share in ((mixed, (0.99, 1.0)), (pure, (0.0, 0.5))):
        before, after, grads = _one_update(worker, device)
        with_gradient = moved = 0
        for name, grad in grads.items():
            live = grad.abs() > 1e-5  # Adam's eps (1e-8) shrinks smaller ones' steps
            step = (before[name] - after[name])[live]
            with_gradient += int(live.sum())
            moved += int((step != 0).sum())
            if worker is mixed:
                torch.testing.assert_close(step, 1e-5 * grad[live].sign(), rtol=5e-3, atol=0)
        assert moved_share[0] <= moved / with_gradient <= moved_share[1], (worker.master_dtype, moved / with_gradient)
    folder = mixed.export_hf(tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    # LoRA: the trained adapters are the float32 masters, the frozen base stays bfloat16 (no copy of
    # the base in float32), and a step moves every adapter weight with a gradient by lr (at the
    # start only the B matrices have one: B = 0)
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear", "rslora": False}
    adapted = Worker({**section, "lora": lora}, mesh, device)
    dtypes = {(".lora_" in n, p.dtype) for n, p in adapted.model.named_parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    before, after, grads = _one_update(adapted, device)
    assert all(".lora_" in name for name in grads) and any(".lora_B." in name for name in grads)
    for name, grad in grads.items():
        live = grad.abs() > 1e-5
        assert live.any() or ".lora_A." in name, name
        torch.testing.assert_close((before[name] - after[name])[live], 1e-5 * grad[live].sign(), rtol=5e-3, atol=0)


def test_one_rank_mixed_precision_is_one_fsdp_unit_and_trains_as_layer_units_do(group, tiny_dir, monkeypatch):
    """bf16 compute with float32 masters at one rank wraps the root alone (no FSDP hook between
    layers); its gradients and weights over two steps, each after a no-grad forward (which leaves
    the root's bf16 copy in place for the update), equal those of a model whose layers are units
    too (the casts and the float32 gradient reduction are the same)."""
    from torch.distributed.fsdp import FSDPModule

    from rl2gem.models import decoder_layers
    from rl2gem.parallel import fsdp

    device, mesh = group
    section = {"model": str(tiny_dir), "dtype": "bfloat16", "lr": 1e-3}
    root = Worker(section, mesh, device)
    monkeypatch.setattr(fsdp, "root_unit_fits", lambda model, dtype, device: False)  # a model too big for it
    layered = Worker(section, mesh, device)
    assert not isinstance(Worker({**section, "master_dtype": "bfloat16"}, mesh, device).model, FSDPModule)
    assert isinstance(root.model, FSDPModule) and not any(isinstance(m, FSDPModule) for m in decoder_layers(root.model))
    assert all(isinstance(m, FSDPModule) for m in decoder_layers(layered.model))
    for _ in range(2):
        for worker in (root, layered):  # old log-probs first, as PPO takes them: the root keeps its cast
            with torch.no_grad():
                token_logprobs(worker.model, [[5, 6, 7, 8, 9, 10]], device)
        (_, ours, our_grads), (_, theirs, their_grads) = (_one_update(w, device) for w in (root, layered))
        assert our_grads.keys() == their_grads.keys() and len(our_grads) == len(list(root.model.parameters()))
        for name in ours:
            torch.testing.assert_close(our_grads[name], their_grads[name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear", "rslora": False}


@pytest.mark.parametrize(
    "extra,head",
    [({"gradient_checkpointing": True}, "lm"), ({"lora": LORA}, "lm"), ({}, "value")],
    ids=["checkpointing", "lora", "critic"],
)
def test_the_root_unit_accumulates_micro_batches_as_layer_units_do(group, tiny_dir, monkeypatch, extra, head):
    """Three micro-batches a step, after a no-grad forward, with activation checkpointing, LoRA's
    float32 adapters over a bf16 base, or a critic's float32 head (a unit of its own): the root
    unit's gradient norms and weights after two steps equal layer units', bitwise."""
    from rl2gem.parallel import fsdp

    device, mesh = group
    section = {"model": str(tiny_dir), "dtype": "bfloat16", "lr": 1e-3, **extra}

    def train(worker) -> tuple[list[float], dict[str, torch.Tensor]]:
        norms = []
        for _ in range(2):
            with torch.no_grad():
                worker.model(input_ids=torch.tensor([[5, 6, 7, 8]]))
            for rows in ([[5, 6, 7, 8, 9, 10]], [[9, 10, 11, 12, 13]], [[3, 4, 5]]):
                if head == "lm":
                    loss = -token_logprobs(worker.model, rows, device)[0].sum()
                else:  # values pulled towards 1 (the head starts at 0)
                    loss = (worker.model(input_ids=torch.tensor(rows)).logits.float() - 1).pow(2).sum()
                loss.backward()
            norms.append(worker.step())
        return norms, worker.full_state_dict(merged=False)

    torch.manual_seed(0)  # LoRA's A matrices
    ours = train(Worker(section, mesh, device, head=head))
    monkeypatch.setattr(fsdp, "root_unit_fits", lambda model, dtype, device: False)
    torch.manual_seed(0)
    theirs = train(Worker(section, mesh, device, head=head))
    assert ours[0] == theirs[0] and min(ours[0]) > 0
    assert ours[1].keys() == theirs[1].keys()
    for name, weight in ours[1].items():
        torch.testing.assert_close(weight, theirs[1][name], rtol=0, atol=0, msg=name)


def test_compiled_layers_raise_dynamo_s_recompile_limit(group, tiny_dir):
    """``actor.compile=true``: every decoder layer's forward goes through ``torch.compile``, and
    dynamo's per-code recompile limit (8 by default, shared by all layers of a class) is raised to
    :data:`~rl2gem.parallel.fsdp.COMPILED_VARIANTS`, so an actor's and its reference's variants
    all stay compiled (past the limit dynamo runs new variants eagerly, silently)."""
    from rl2gem.models import decoder_layers
    from rl2gem.parallel.fsdp import COMPILED_VARIANTS

    device, mesh = group
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default, restored after
        worker = Worker({"model": str(tiny_dir), "compile": True}, mesh, device, trainable=False)
        assert torch._dynamo.config.recompile_limit == COMPILED_VARIANTS >= 32
    layers = decoder_layers(worker.model)
    assert layers and all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_out_of_memory_under_fsdp_is_retried_and_the_retry_trains(group, tiny_dir, tmp_path, where):
    """bf16 with float32 master weights is FSDP2 at one rank (CUDA's default). An out-of-memory
    error inside the backward left FSDP mid-backward: the retry's gradients went to the unsharded
    parameters, not the shards AdamW steps, and the weights stopped changing with no error. After
    the back-off (``MaxLength.run``) the retry's step equals a step that never failed."""
    from torch.distributed.fsdp import FSDPModule

    from rl2gem.models import decoder_layers
    from rl2gem.training.autosize import MaxLength

    device, mesh = group
    section = {"model": str(tiny_dir), "dtype": "bfloat16", "lr": 1e-3, "max_length_per_device": 1024}
    clean, worker = Worker(section, mesh, device), Worker(section, mesh, device)
    assert isinstance(worker.model, FSDPModule)
    sequences = [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12]]

    def passes(target):
        logprobs, _ = token_logprobs(target.model, sequences, device)
        (-logprobs.sum()).backward()

    armed = [True]

    def out_of_memory(*_):
        if armed[0]:
            armed[0] = False
            raise torch.OutOfMemoryError("simulated")

    def in_backward(module, inputs, output):
        output = output[0] if isinstance(output, tuple) else output
        output.register_hook(out_of_memory)

    layer = decoder_layers(worker.model)[1]
    hook = (
        layer.register_forward_hook(in_backward)
        if where == "backward"
        else layer.register_forward_pre_hook(out_of_memory)
    )
    length = MaxLength(section, [worker], mesh, device, tmp_path)
    with pytest.warns(UserWarning, match="retrying the step at 512"):
        length.run(lambda: passes(worker), longest=6)
    hook.remove()
    assert not armed[0]
    passes(clean)
    for target in (clean, worker):
        target.step()
    for (name, want), have in zip(clean.model.named_parameters(), worker.model.parameters(), strict=True):
        torch.testing.assert_close(_full_float32(have), _full_float32(want), msg=name)
    passes(worker)  # and the next step trains too
    assert sum(p.grad is not None for p in worker.model.parameters()) == len(list(worker.model.parameters()))


def test_a_restored_optimizer_keeps_its_own_implementation(group, tiny_dir, tmp_path, monkeypatch):
    """A checkpoint written by a foreach AdamW, loaded into a fused one (the CPU's fused kernel
    standing in for CUDA's), and back: the loaded groups keep the loading worker's ``fused``
    (a checkpoint's groups carry the writer's), its step counts sit where it reads them (float32
    on the parameter's device when fused, the host otherwise), and the next step equals the
    writer's own next step."""
    device, mesh = group
    section = {"model": str(tiny_dir), "lr": 1e-2}
    plain = Worker(section, mesh, device)
    assert plain.fused_optimizer is False and all(g["fused"] is None for g in plain.optimizer.param_groups)
    train_once(plain, device)
    Checkpointer(tmp_path / "plain", {"actor": plain}).save(1)
    monkeypatch.setattr("rl2gem.training.worker.fused_adamw", lambda parameters: True)
    fused = Worker(section, mesh, device)
    assert fused.fused_optimizer is True
    Checkpointer(tmp_path / "plain", {"actor": fused}).load()
    assert all(g["fused"] is True for g in fused.optimizer.param_groups)
    steps = [state["step"] for state in fused.optimizer.state.values()]
    assert steps and all(s.dtype == torch.float32 and s.device == device and float(s) == 1 for s in steps)
    expected = train_once(plain, device)
    assert train_once(fused, device) == pytest.approx(expected, rel=1e-5)
    for (name, a), b in zip(plain.full_state_dict().items(), fused.full_state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # and back: a fused run's checkpoint into a foreach worker leaves it foreach
    Checkpointer(tmp_path / "fused", {"actor": fused}).save(2)
    monkeypatch.undo()
    again = Worker(section, mesh, device)
    Checkpointer(tmp_path / "fused", {"actor": again}).load()
    assert all(g["fused"] is None for g in again.optimizer.param_groups)
    assert all(state["step"].device.type == "cpu" for state in again.optimizer.state.values())


def test_stepped_lr_is_the_rate_the_optimizer_step_used(group, tiny_dir):
    """actor/lr logged the scheduler's rate after its step: the next step's (warm-up of 2 steps to
    1e-2: the steps use 5e-3, 1e-2, 1e-2; 1e-2 was logged for the first)."""
    device, mesh = group
    worker = Worker({"model": str(tiny_dir), "lr": 1e-2, "warmup_steps": 2}, mesh, device, total_steps=10)
    used = []
    for _ in range(3):
        train_once(worker, device)
        used.append(worker.stepped_lr)
    assert used == pytest.approx([5e-3, 1e-2, 1e-2]) and worker.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
