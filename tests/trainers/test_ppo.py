"""The PPO trainer: config errors, FSDP2 equivalence over 2 ranks, a 2-step 2-rank smoke run."""

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT, logged_steps, torchrun, torchrun_command
from rl2gem.trainers import ppo
from tiny import tiny_family_model


def arithmetic_run(model) -> list[str]:
    """The PPO trainer on two-term arithmetic with 2 groups of 2 per step."""
    return [
        "trainers/ppo.py",
        "env=rl2/ReasoningGym-v0",
        "env_kwargs.task=basic_arithmetic",
        f"actor.model={model}",
        "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=2",
    ]


# The entropy bonus gives non-zero gradients even when the tiny random model earns no reward, so
# weights, Adam moments and therefore the sampled tokens change every step (resume tests).
MOVING_WEIGHTS = ["rollout.temperature=20.0", "actor.lr=3e-3", "actor.entropy_coef=0.05"]


def test_unknown_config_key_names_the_closest(capsys):
    """In process: each bad argument ends ``main`` with 2 and one line before anything is built
    (tests/training/test_config_errors.py checks the same under torchrun)."""
    for arguments, message in [
        (["actor.lrr=1e-5"], "did you mean 'actor.lr'"),
        (["adv"], "key=value"),
        (
            ["reward.objectives.combine=tchebycheff", "reward.objectives.weights={correctness: 1}"],
            "reward.objectives.reference needs a value for ['correctness']",
        ),
        (["reward.objectives.pareto={response_tokens: min}"], "hypervolume reference"),
        (["rollout.engine.decode_step=4"], "did you mean 'rollout.engine.decode_steps'"),
        (
            ["rollout.responses_per_prompt=1", "adv.estimator=rloo"],
            "rollout.responses_per_prompt=1: adv.estimator=rloo compares the responses to one prompt",
        ),
        (["env_kwargs.tsk=x"], "env_kwargs: rl2/ReasoningGym-v0 with {'tsk': 'x'}: TypeError: reasoning-gym task"),
        (["eval_env_kwargs.min_terms=-3"], "eval_env_kwargs: rl2/ReasoningGym-v0 with {'min_terms': -3}: ValueError"),
        (["rollout.engine.decode_steps=0"], "rollout.engine.decode_steps=0 must be an int >= 1 or auto"),
        (["rollout.engine.decode_graphs=maybe"], "rollout.engine.decode_graphs='maybe' must be true or false or auto"),
        (
            ["rollout.engine.decode_graphs=false", "rollout.engine.decode_overlap=true"],
            "rollout.engine.decode_overlap=true needs decode graphs",
        ),
        (["rollout.engine.max_batch_size=auto"], "rollout.engine.max_batch_size='auto' must be an int >= 1"),
        (["rollout.engine.prefix_cache_tokens=null"], "rollout.engine.prefix_cache_tokens: expected an int, got null"),
    ]:
        assert ppo.main(arguments) == 2
        assert message in capsys.readouterr().err, arguments


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 (per-head q/k RMSNorm) with 1024 token ids (``fsdp_equivalence.py``
    draws ids below 1000)."""
    folder = tmp_path_factory.mktemp("qwen3")
    tiny_family_model("qwen3", vocab_size=1024).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def one_rank_reference(tmp_path_factory):
    """The one-process result of ``fsdp_equivalence.py`` for a model and data options, run once
    per pair."""
    cache: dict = {}

    def reference(model_dir, options: tuple[str, ...]) -> dict:
        if (model_dir, options) not in cache:
            out = tmp_path_factory.mktemp("one") / "one.json"
            torchrun(1, str(ROOT / "tests" / "parallel" / "fsdp_equivalence.py"), str(model_dir), str(out), *options)
            cache[model_dir, options] = json.loads(out.read_text())
        return cache[model_dir, options]

    return reference


UNEVEN = "lengths=3,1,17,40,90,9"  # shorter than 2*sp tokens, one token, longer than max_tokens=50


@pytest.mark.parametrize(
    "ranks,options",
    [
        (2, ()),
        (2, ("ddp_size=2",)),
        (2, ("cpu_offload=1", "gradient_checkpointing=1")),
        (2, ("tp_size=2", UNEVEN, "max_tokens=50")),
        (2, ("sp_size=2", UNEVEN, "max_tokens=50")),
        (2, ("lora=4", "gradient_checkpointing=1")),
        (4, ("tp_size=2", UNEVEN, "max_tokens=50")),
        (4, ("sp_size=2", "tp_size=2", UNEVEN, "max_tokens=50")),
        (2, ("tp_size=2", "model=qwen3")),
    ],
    ids=["fsdp", "hsdp", "offload+checkpointing", "tp", "sp", "lora", "fsdp2xtp2", "sp2xtp2", "tp-qwen3"],
)
def test_fsdp_ranks_equal_one(request, tmp_path, one_rank_reference, ranks, options):
    """FSDP2 over 2 ranks (plain, HSDP replicas, CPU offload with activation checkpointing, LoRA
    adapters beside frozen base shards), tensor parallelism over 2 ranks, ZigZag sequence
    parallelism over 2 ranks (on uneven packed lengths), and over 4 ranks FSDP's 2 shards of each
    tensor-parallel half (and 2 SP x 2 TP) give one process's logits, per-token log-probs, loss and
    gradients (one process runs the model without an FSDP wrapper). Qwen3 under tensor
    parallelism: its per-head q/k norms, whose inputs each rank holds a part of."""
    script = str(ROOT / "tests" / "parallel" / "fsdp_equivalence.py")
    model_dir = request.getfixturevalue("qwen3_dir" if "model=qwen3" in options else "tiny_dir")
    options = tuple(o for o in options if not o.startswith("model="))
    one = one_rank_reference(model_dir, tuple(o for o in options if o.startswith(("lengths=", "max_tokens=", "lora="))))
    torchrun(ranks, script, str(model_dir), str(tmp_path / "two.json"), *options)
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["fsdp"] and not one["fsdp"]  # one rank runs the plain module: FSDP would only copy
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-7)
    assert one["params"] == pytest.approx(two["params"], rel=1e-6)
    assert two["logprobs"] == pytest.approx(one["logprobs"], rel=1e-6, abs=1e-5)
    if two["logits"] is not None:
        assert two["logits"] == pytest.approx(one["logits"], rel=1e-6, abs=1e-5)
    assert one["grads"].keys() == two["grads"].keys()
    if "lora=4" in options:  # only the adapters train, and every one has a gradient
        assert one["grads"] and all(".lora_" in name for name in one["grads"])
        assert all(g[-1] > 0 for g in one["grads"].values())
    for name, g in one["grads"].items():
        assert g == pytest.approx(two["grads"][name], rel=1e-4, abs=1e-7), name


def test_two_rank_smoke_run_logs_evaluates_and_exports(tiny_dir, tmp_path):
    out = tmp_path / "run"
    stdout = torchrun(
        2,
        "trainers/ppo.py",
        "env=rl2/Countdown-v0",
        f"actor.model={tiny_dir}",
        "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=2",
        "rollout.max_new_tokens=8",
        "trainer.total_steps=2",
        "trainer.eval_n=4",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
        "kl.coef=0.01",
        # a combined reward and a Pareto archive of the evaluations
        "reward.objectives.combine=weighted_sum",
        "reward.objectives.weights={reward: 1.0, length: -0.01}",
        "reward.objectives.pareto={reward: max, response_tokens: min}",
        "reward.objectives.hv_reference={response_tokens: 100}",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "rollout/reward",
        "rollout/response_length",
        "actor/kl",
        "actor/clip_ratio",
        "actor/entropy",
        "actor/grad_norm",
        "perf/tokens_per_second",
        "perf/mfu",
        "time/rollout",
    ):
        assert key in steps[0], key
    assert any("eval/success" in r for r in rows)
    # peak RSS per phase (max over ranks): at least the model, its Adam moments and the engine's copy
    for phase in ("rollout", "score", "update", "weight_sync"):
        assert steps[0][f"memory/{phase}_peak_mib"] > 100, phase
    assert rows[-1]["memory/eval_peak_mib"] > 100
    assert steps[0]["rollout/component/length"] == pytest.approx(steps[0]["rollout/response_length"])
    # rollout/reward is the combined reward trained on (reward - 0.01 * length), the env's kept apart
    assert steps[0]["rollout/component/reward"] == pytest.approx(steps[0]["rollout/env_reward"])
    combined = steps[0]["rollout/component/reward"] - 0.01 * steps[0]["rollout/component/length"]
    assert steps[0]["rollout/reward"] == pytest.approx(combined)
    evals = [r for r in rows if "pareto/size" in r]
    assert len(evals) == 2 and evals[-1]["pareto/size"] >= 1  # at the start and at the end
    archive = json.loads((out / "pareto.json").read_text())["points"]
    assert len(archive) == evals[-1]["pareto/size"] and {"reward", "response_tokens"} == set(archive[0]["values"])
    assert (out / "curves.png").stat().st_size > 1000 and (out / "config.yaml").exists()
    assert "final eval" in stdout and "| step | rollout/reward |" in stdout
    from transformers import AutoModelForCausalLM

    hf = out / "checkpoint-2" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.num_hidden_layers == 2


def _descendants(pid):
    """All live descendants of ``pid`` (from /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_resume_after_kill_9_matches_an_uninterrupted_run(tiny_dir, tmp_path):
    """kill -9 after the step-2 checkpoint, resume: steps 3-4 equal the uninterrupted run's.

    Multi-turn two-hop search with the history managed in 160-token segments and summaries
    (rollout.context), so the resumed rollouts must also start the same segments and write the same
    summaries. The entropy bonus gives non-zero gradients even when the tiny random model earns no
    reward, so weights, Adam moments and therefore the sampled tokens change every step. The old
    log-probs are recomputed and the importance weights against the engine's log-probs are off, and
    each rank's engine decodes one request at a time: the engine's logits depend at the 1e-8 level
    on which requests share a decode batch (multi-turn requests meet in different batches from run
    to run, more so on a loaded machine), which at this test's temperature of 20 can flip a sampled
    token: with two requests per engine, a loaded machine gave weights 2.4e-3 apart after 4 steps
    while every logged metric agreed."""
    import signal
    import time

    args = [
        "trainers/ppo.py",
        "env=rl2/MultiHopQA-v0",
        f"actor.model={tiny_dir}",
        "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=1",  # one request in flight per rank: see the docstring
        "adv.estimator=reinforce_pp",  # a group estimator refuses groups of one
        "rollout.concurrency=1",
        "rollout.dynamic_filter=false",
        "rollout.max_new_tokens=12",
        "rollout.context.max_tokens=160",
        "rollout.context.policy=summarize",
        "rollout.context.summary_max_new_tokens=8",
        "actor.old_logprobs=recompute",
        "actor.is_mode=none",
        *MOVING_WEIGHTS,
        "trainer.total_steps=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=1",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        "trainer.progress=false",
        "seed=7",
        # an adaptive KL coefficient: its state must come back with the checkpoint
        "kl.coef=0.05",
        "kl.adaptive.type=exponential",
        "kl.adaptive.exp_factor=2.0",
        "kl.adaptive.exp_decay=0.5",
        "kl.adaptive.target_kl=1e-4",
        # Lagrange multipliers: their state must come back too
        "constraints.entropy.bound=20",
        "constraints.kl.bound=1e-5",
        "constraints.lagrangian_lr=0.01",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    torchrun(2, *args, f"trainer.output_dir={full}")
    cmd, env = torchrun_command(2, *args, f"trainer.output_dir={cut}")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while not ((cut / "latest").exists() and (cut / "latest").read_text() == "checkpoint-2"):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
            time.sleep(0.05)
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun starts its workers in their own sessions
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    time.sleep(3)  # a surviving worker would go on to step 4
    assert not (cut / "checkpoint-4").exists() and (cut / "latest").read_text() == "checkpoint-2"
    stdout = torchrun(2, *args, f"trainer.output_dir={cut}", "trainer.resume=true")
    assert "resumed from step 2" in stdout
    a, b = logged_steps(full / "metrics.jsonl", "actor/pg_loss"), logged_steps(cut / "metrics.jsonl", "actor/pg_loss")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert a[4]["actor/grad_norm"] > 0
    assert len({a[s]["rollout/tokens"] for s in a}) > 1  # prompts differ from step to step
    assert len({a[s]["kl/coef"] for s in a}) > 1  # the controller moved the coefficient
    assert all(a[s]["rollout/context_segments"] > 0 and a[s]["rollout/summaries"] > 0 for s in a)
    for step in (3, 4):
        for key in (
            "rollout/reward",
            "rollout/response_length",
            "rollout/tokens",
            "actor/pg_loss",
            "actor/entropy",
            "actor/grad_norm",
            "actor/lr",
            "actor/kl",
            "kl/coef",
            "constraint/entropy_multiplier",
            "constraint/kl_multiplier",
            "rollout/context_segments",
            "rollout/summaries",
            "actor/is_weight",
        ):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    # dual ascent by hand from the logged entropy and KL (entropy < 20 nats: always violated)
    multipliers = {"entropy": 0.0, "kl": 0.0}
    for step in (1, 2, 3, 4):
        for name in multipliers:
            assert a[step][f"constraint/{name}_multiplier"] == pytest.approx(multipliers[name], rel=1e-6, abs=1e-9)
        multipliers["entropy"] = max(0.0, multipliers["entropy"] + 0.01 * (20 - a[step]["actor/entropy"]))
        multipliers["kl"] = max(0.0, multipliers["kl"] + 0.01 * (a[step]["actor/kl"] - 1e-5))
    assert multipliers["entropy"] > 0.3
    from safetensors.torch import load_file

    for run in (full, cut):  # keep_checkpoints=1: the older checkpoint keeps its export, not its shards
        assert not (run / "checkpoint-2" / "dcp").exists() and (run / "checkpoint-2" / "hf").exists()
        assert (run / "checkpoint-4" / "dcp").exists()
    wa = load_file(full / "checkpoint-4" / "hf" / "model.safetensors")
    wb = load_file(cut / "checkpoint-4" / "hf" / "model.safetensors")
    for name, t in wa.items():
        assert (t - wb[name]).abs().max().item() < 1e-5, name


def test_token_values_and_gae_align_with_the_state_before_each_token():
    """Packed critic values: entry t is V(state before token t), read at t-1; GAE on top by hand."""
    import types

    import torch

    from rl2gem.training import Sample, apply_critic_estimator, token_values

    class IdCritic(torch.nn.Module):  # value = the id of the token just read
        config = types.SimpleNamespace(_attn_implementation="sdpa")

        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False):
            return types.SimpleNamespace(logits=input_ids.float()[..., None] + 0 * self.p)

    a = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, None, [0.0, 0.0, 0.0, 1.0], [0] * 4)
    b = Sample([9, 10, 11], [0, 1, 1], [0.0] * 3, None, [0.0, 2.0, 0.0], [0] * 3)
    v = token_values(IdCritic(), [a.ids, b.ids], torch.device("cpu"))
    assert v.tolist() == [0, 5, 6, 7, 0, 9, 10]
    rets = apply_critic_estimator([a, b], v, torch.zeros(7), "gae", gamma=1.0, lam=1.0)
    # sequence a: action tokens 2, 3 with V = 6, 7; return 1 from both -> advantages 1-6, 1-7
    assert a.advantages == [0, 0, -5, -6] and a.returns == [0, 0, 1, 1]
    # sequence b: rewards 2 then 0 -> returns 2, 0; V = 9, 10
    assert b.advantages == [0, -7, -10] and b.returns == [0, 2, 0]
    assert rets.tolist() == [0, 0, 1, 1, 0, 2, 0]
    a2 = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, None, [0.0, 0.0, 0.0, 1.0], [0] * 4)
    v2 = token_values(IdCritic(), [a2.ids], torch.device("cpu"))
    apply_critic_estimator([a2], v2, torch.zeros(4), "gae", gamma=0.5, lam=0.5)
    # delta_3 = 1 - 7 = -6; delta_2 = 0 + 0.5 * 7 - 6 = -2.5; A_2 = -2.5 + 0.25 * -6 = -4
    assert a2.advantages == pytest.approx([0, 0, -4.0, -6.0])


def test_vtrace_weights_each_token_by_its_own_behaviour_policy(capsys):
    """apply_critic_estimator: the ratio of each action token is exp(old - rollout log-prob); V-trace
    by hand on two action tokens, the first sampled by a policy that gave it twice pi's probability."""
    import math

    import torch

    from rl2gem.training import Sample, apply_critic_estimator

    old = torch.tensor([0.0, 0.0, -1.0, -2.0])
    s = Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.0 + math.log(2), -2.0], None, [0.0, 0.0, 0.0, 1.0], [0] * 4)
    values = torch.tensor([0.0, 5.0, 6.0, 7.0])
    returns = apply_critic_estimator([s], values, old, "vtrace", rho_bar=1.0, c_bar=1.0)
    # rho = (0.5, 1): delta'_3 = 1 - 7 = -6, v_3 = 1; delta'_2 = 0.5 (7 - 6), v_2 = 6 + 0.5 + 0.5 * -6 = 3.5
    # A_3 = 1 - 7 = -6; A_2 = 0.5 (0 + v_3 - 6) = -2.5
    assert s.returns == pytest.approx([0, 0, 3.5, 1]) and s.advantages == pytest.approx([0, 0, -2.5, -6])
    assert returns.tolist() == pytest.approx([0, 0, 3.5, 1])
    assert ppo.main(["adv.estimator=multistep", "adv.multistep.n_steps=0"]) == 2
    err = capsys.readouterr().err
    assert "adv.multistep" in err and "n_steps" in err


def test_gae_critic_run_with_kl_in_reward(tiny_dir, tmp_path, capsys):
    """adv.estimator=gae builds a critic: values, value loss and its checkpoint; KL enters the
    rewards (the entropy bonus moves the actor away from the reference after step 1). Partial
    rollouts: later steps train on tokens older weights sampled, and the final evaluation runs on
    the engine they left paused."""
    out = tmp_path / "gae"
    torchrun(
        2,
        *arithmetic_run(tiny_dir),
        "rollout.max_new_tokens=8",
        "rollout.temperature=20",
        "adv.estimator=gae",
        "kl.coef=1.0",
        "kl.in_reward=true",
        "kl.adaptive.type=exponential",
        "kl.adaptive.exp_factor=1.5",
        "kl.adaptive.exp_decay=0.5",
        "kl.adaptive.target_kl=1e-3",
        "rollout.partial_rollout=true",
        "rollout.partial_oversample=1.0",
        "rollout.max_staleness=2",
        "actor.entropy_coef=0.05",
        "actor.lr=3e-3",
        "critic.lr=1e-2",
        "trainer.total_steps=3",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
    )
    steps = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    assert steps[1]["critic/values"] == 0.0 and steps[1]["critic/vf_loss"] == 0.0  # zero head, zero KL at step 1
    assert steps[3]["actor/kl"] > 0 and steps[3]["critic/vf_loss"] > 0 and steps[3]["critic/values"] != 0.0
    assert (out / "checkpoint-3" / "dcp").exists()
    assert steps[1]["rollout/stale_token_fraction"] == 0
    assert max(steps[s]["rollout/stale_token_fraction"] for s in (2, 3)) > 0
    for s in (2, 3):  # tokens of an older policy: the old log-probs are recomputed, never the engine's
        if steps[s]["rollout/stale_token_fraction"] > 0:
            assert steps[s]["actor/old_logprobs_from_rollout"] == 0.0
    assert "eval/success" in logged_steps(out / "metrics.jsonl", "eval/success")[3]
    # the exponential controller, by hand from the logged KL: x1.5 above the target, x0.5 below
    coef = 1.0
    for step in (1, 2, 3):
        assert steps[step]["kl/coef"] == pytest.approx(coef) and steps[step]["kl/target"] == 1e-3
        kl = steps[step]["actor/kl"]
        coef *= 1.5 if kl > 1e-3 else 0.5 if kl < 1e-3 else 1.0
    assert ppo.main(["kl.coef=0.1", "kl.in_reward=true", "adv.estimator=grpo"]) == 2
    err = capsys.readouterr().err
    assert "kl.in_reward=true: adv.estimator=grpo computes its advantages as the rollout is collected" in err
    assert ppo.main(["kl.adaptive.type=bang_bang"]) == 2
    err = capsys.readouterr().err
    assert "kl.adaptive" in err and "proportional" in err


def test_on_policy_steps_use_the_rollout_logprobs_and_equal_recomputing_them(tiny_dir, tmp_path, capsys):
    """actor.old_logprobs=auto takes the trainer's log-probs in step 1 from the update's own forward,
    finds the engine's log-probs within the mismatch-KL bound of the trainer's, and from step 2 on
    uses the engine's: its steps equal a run that always recomputes in a pass of its own (a bound nothing meets, which keeps auto recomputing, is
    tests/training/test_online_parts.py's). The rollout choice is refused where the update is not
    exactly on-policy."""
    runs = {}
    options = [
        ("auto", "auto"),
        ("recompute", "recompute"),
        ("minibatches", "recompute actor.minibatches_per_update=2"),
        # the engine's options from the config: graphs (eager on the CPU), 4 steps a round, queued ahead
        (
            "engine",
            "recompute rollout.engine.decode_graphs=true rollout.engine.decode_steps=4 "
            "rollout.engine.decode_overlap=true rollout.engine.max_batch_size=8",
        ),
    ]
    for name, option in options:
        out = tmp_path / name
        torchrun(
            1,
            *arithmetic_run(tiny_dir),
            "rollout.responses_per_prompt=4",  # 4 samples a group: rewards that differ within a group
            "rollout.max_new_tokens=8",
            *MOVING_WEIGHTS,
            "reward.transform=tests.toy_envs:even_token_reward",
            *f"actor.old_logprobs={option}".split(),
            "trainer.total_steps=3",
            "trainer.eval_at_start=false",
            "trainer.eval_n=2",
            f"trainer.output_dir={out}",
            "trainer.progress=false",
        )
        runs[name] = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    auto, recompute = runs["auto"], runs["recompute"]
    # the 8 sequences fit one micro-batch (2048 tokens on the CPU); two minibatches still get a
    # micro-batch each, so the pass takes two optimizer steps, not one
    for step in (1, 2, 3):
        assert auto[step]["actor/optimizer_steps"] == recompute[step]["actor/optimizer_steps"] == 1.0
        assert auto[step]["perf/micro_batches"] == 1.0
        assert runs["minibatches"][step]["actor/optimizer_steps"] == 2.0
        assert runs["minibatches"][step]["perf/micro_batches"] >= 2.0
    assert runs["minibatches"][1]["rollout/reward"] == auto[1]["rollout/reward"]  # same weights, same samples
    assert [auto[s]["actor/old_logprobs_from_rollout"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    # auto's check step takes the trainer's log-probs from the update's own forward (no separate
    # pass; its metrics below equal the separate pass's); recompute keeps the pass
    assert [auto[s]["actor/old_logprobs_from_update"] for s in (1, 2, 3)] == [1.0, 0.0, 0.0]
    assert all(recompute[s]["actor/old_logprobs_from_update"] == 0.0 for s in (1, 2, 3))
    # the engine's counters of each step's rollout (on the CPU one decode step per host round trip)
    for step in (1, 2, 3):
        engine = {k.removeprefix("engine/"): v for k, v in auto[step].items() if k.startswith("engine/")}
        assert engine["decode_steps"] == engine["decode_rounds"] >= 1 and engine["prefill_forwards"] >= 1
        assert engine["decode_graph_captures"] == 0 and engine["time_decode_s"] >= 0  # no graphs on the CPU
        parts = engine["time_decode_forward_s"] + engine["time_decode_handout_s"]
        assert engine["time_decode_handout_s"] > 0 and parts <= engine["time_decode_s"] + 1e-9
    for step in (1, 2, 3):  # rollout.engine reached the engine: 4 steps a round, rounds queued ahead
        engine = {k.removeprefix("engine/"): v for k, v in runs["engine"][step].items() if k.startswith("engine/")}
        assert engine["decode_steps"] > engine["decode_rounds"] and engine["decode_rounds_ahead"] > 0, engine
        assert runs["engine"][step]["actor/mismatch_kl"] < 1e-6  # the decode graphs' log-probs, the trainer's
    assert 0.0 <= auto[1]["actor/old_logprob_max_diff"] <= 1e-3  # the engine's log-probs are the trainer's
    assert 0.0 <= auto[1]["actor/old_logprob_mismatch_kl"] <= 1e-6
    assert all(recompute[s]["actor/old_logprobs_from_rollout"] == 0.0 for s in (1, 2, 3))
    assert "actor/old_logprob_max_diff" not in recompute[1] and "actor/old_logprob_mismatch_kl" not in recompute[1]
    # rollout/reward is the transformed reward trained on; the random model's env reward is kept apart
    assert auto[1]["rollout/env_reward"] == 0.0 < auto[1]["rollout/reward"]
    for step in (1, 2):  # same samples (same weights after step 1), the same update
        assert auto[step]["rollout/reward"] == recompute[step]["rollout/reward"]
        # non-zero advantages, so the old log-probs enter the gradient through the importance ratio
        # (pg_loss itself may be exactly 0 on-policy: +A and -A over responses of equal length)
        assert auto[step]["rollout/zero_variance_groups"] < 1.0 and auto[step]["actor/grad_norm"] > 0
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/mismatch_kl"):
            assert auto[step][key] == pytest.approx(recompute[step][key], rel=1e-4, abs=1e-7), (step, key)
    assert ppo.main(["actor.old_logprobs=rollout", "actor.update_per_rollout=2"]) == 2
    assert "exactly on-policy" in capsys.readouterr().err
    assert ppo.main(["actor.old_logprobs=engine"]) == 2
    assert "actor.old_logprobs" in capsys.readouterr().err


def test_tree_packing_steps_equal_flat_packing_on_fewer_tokens(tiny_dir, tmp_path, capsys):
    """actor.packing=tree (each group's shared prompt computed once) against flat packing: the same
    gradients and values, with a critic (GAE), a reference model (KL) and an entropy bonus, on 2
    ranks; the forwards compute fewer tokens."""
    runs = {}
    for packing in ("flat", "tree"):
        out = tmp_path / packing
        torchrun(
            2,
            *arithmetic_run(tiny_dir),
            "rollout.responses_per_prompt=4",
            "rollout.max_new_tokens=8",
            *MOVING_WEIGHTS,
            "reward.transform=tests.toy_envs:even_token_reward",
            "adv.estimator=gae",
            "kl.coef=0.01",
            f"actor.packing={packing}",
            "actor.max_length_per_device=256",
            "trainer.total_steps=2",
            "trainer.eval_at_start=false",
            "trainer.eval_n=2",
            f"trainer.output_dir={out}",
            "trainer.progress=false",
        )
        runs[packing] = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    flat, tree = runs["flat"], runs["tree"]
    for step in (1, 2):
        assert flat[step]["perf/computed_token_fraction"] == 1.0
        assert tree[step]["perf/computed_token_fraction"] < 0.9  # 4 samples per prompt share it
        assert tree[step]["rollout/reward"] == flat[step]["rollout/reward"]
        # the gradients of the whole loss (PPO + KL + entropy; the critic's value loss) are the flat
        # ones, and so are the per-token metrics, means over the step's action tokens however the
        # two packings cut the micro-batches, and so are the losses (sums of the micro-batches' shares)
        for key in ("actor/grad_norm", "critic/grad_norm", "critic/values", "actor/kl", "actor/entropy"):
            assert tree[step][key] == pytest.approx(flat[step][key], rel=1e-5, abs=1e-9), (step, key)
        assert tree[step]["actor/clip_ratio"] == pytest.approx(flat[step]["actor/clip_ratio"], abs=1e-9)
        for key in ("actor/pg_loss", "critic/vf_loss"):
            assert tree[step][key] == pytest.approx(flat[step][key], rel=1e-4, abs=1e-7), (step, key)
    assert ppo.main(["actor.packing=tree", "actor.sp_size=2"]) == 2
    err = capsys.readouterr().err
    assert "actor.packing=tree" in err


def test_lora_ppo_on_two_ranks_syncs_merged_weights_and_exports_the_adapter(tiny_dir, tmp_path):
    """actor.lora on 2 FSDP ranks: the adapters train, each step's weight sync gives the engine the
    merged model (its log-probs equal the trainer's: mismatch KL ~0 after the weights moved), and
    every checkpoint holds the merged model and the adapter in peft's format."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl2gem.training import token_logprobs

    out = tmp_path / "lora"
    torchrun(
        2,
        *arithmetic_run(tiny_dir),
        "rollout.max_new_tokens=8",
        "reward.transform=tests.toy_envs:even_token_reward",  # rewards that differ within a group
        "actor.lora.rank=4",
        "actor.lora.alpha=1024",  # a large scale: the few steps move the model far enough to see
        "actor.lr=3e-2",
        "actor.entropy_coef=0.05",
        "actor.old_logprobs=recompute",  # every step measures engine against trainer (mismatch KL)
        "trainer.total_steps=3",
        "trainer.save_every=1",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
    )
    steps = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    assert all(steps[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))
    assert all(abs(steps[s]["actor/mismatch_kl"]) < 1e-6 for s in (1, 2, 3)), steps
    sequence = [[1, 50, 60, 70, 80, 90, 100]]
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        reference = token_logprobs(base, sequence, torch.device("cpu"))[0]
        for step in (1, 3):
            hf = out / f"checkpoint-{step}" / "hf"
            merged = token_logprobs(AutoModelForCausalLM.from_pretrained(hf).eval(), sequence, torch.device("cpu"))[0]
            # the weights moved: an engine left on the base would have shown a mismatch
            assert float((merged - reference).abs().max()) > 1e-2
            adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), hf / "adapter").eval()
            torch.testing.assert_close(
                token_logprobs(adapted, sequence, torch.device("cpu"))[0], merged, atol=1e-4, rtol=0
            )
    config = json.loads((out / "checkpoint-3" / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


# slow: TP and SP equivalence: test_fsdp_ranks_equal_one[tp|sp|fsdp2xtp2|sp2xtp2]; resume: test_resume_after_kill_9_...
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("actor.ddp_size=2", "actor.tp_size=2"),
        ("actor.sp_size=2", "adv.estimator=vtrace"),
    ],
    ids=["ddp2xtp2", "fsdp2xsp2+vtrace"],
)
def test_four_rank_tp_and_sp_runs_resume_identically(tiny_dir, tmp_path, layout):
    """PPO on 4 ranks (HSDP 2 x TP 2; FSDP 2 x SP 2 with a critic and V-trace) for two steps; a copy of the run resumed from its step-1 checkpoint under the same layout
    repeats step 2 exactly."""
    import shutil

    args = [
        *arithmetic_run(tiny_dir),
        *layout,
        "rollout.prompts_per_rollout=4",
        "rollout.max_new_tokens=12",
        *MOVING_WEIGHTS,
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        "trainer.progress=false",
        "seed=3",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    torchrun(4, *args, f"trainer.output_dir={full}")
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoint-2")
    (cut / "latest").write_text("checkpoint-1")
    assert "resumed from step 1" in torchrun(4, *args, f"trainer.output_dir={cut}", "trainer.resume=true")
    a, b = logged_steps(full / "metrics.jsonl", "actor/pg_loss"), logged_steps(cut / "metrics.jsonl", "actor/pg_loss")
    assert sorted(a) == sorted(b) == [1, 2]
    assert a[2]["actor/grad_norm"] > 0
    for key in ("rollout/tokens", "rollout/response_length", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-4, abs=1e-6), key
    if "adv.estimator=vtrace" in layout:
        assert b[2]["critic/vf_loss"] == pytest.approx(a[2]["critic/vf_loss"], rel=1e-4, abs=1e-6)
        assert a[1]["actor/is_weight"] == a[2]["actor/is_weight"] == 1.0  # V-trace weights the advantages instead


BACKOFF_RUN = [
    "rollout.max_new_tokens=64",
    "rollout.temperature=20",
    "adv.estimator=gae",  # a critic: its values and returns are regrouped onto the finer plan
    "actor.entropy_coef=0.05",
    "actor.lr=3e-3",
    "trainer.total_steps=2",
    "trainer.eval_at_start=false",
    "trainer.eval_n=2",
    "trainer.progress=false",
]


def test_out_of_memory_backs_off_and_the_step_equals_one_run_at_the_smaller_length(tiny_dir, tmp_path):
    """On a simulated device (100 MiB of activations, a few hundred tokens of the tiny model), a
    step planned at 1024 tokens (the whole batch in one micro-batch) runs out of memory before any
    optimizer step; the trainer halves the length until the passes fit and runs them again. The
    step then equals a run planned at the final length from the start."""
    backoff, direct = tmp_path / "backoff", tmp_path / "direct"
    torchrun(
        1,
        *arithmetic_run(tiny_dir),
        *BACKOFF_RUN,
        "actor.max_length_per_device=1024",
        f"trainer.output_dir={backoff}",
        env={"RL2GEM_SIMULATED_MEMORY_MIB": "100"},
    )
    got = logged_steps(backoff / "metrics.jsonl", "actor/pg_loss")
    length = int(got[1]["actor/max_length_per_device"])
    assert length < 1024 and got[2]["actor/max_length_per_device"] == length
    torchrun(
        1,
        *arithmetic_run(tiny_dir),
        *BACKOFF_RUN,
        f"actor.max_length_per_device={length}",
        "trainer.total_steps=1",  # only step 1 is compared
        f"trainer.output_dir={direct}",
    )
    want = logged_steps(direct / "metrics.jsonl", "actor/pg_loss")
    for key in ("rollout/reward", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss"):
        assert got[1][key] == pytest.approx(want[1][key], rel=1e-4, abs=1e-6), key
    assert "eval/success" in logged_steps(backoff / "metrics.jsonl", "eval/success")[2]


# slow: tests/training/test_autosize.py::test_out_of_memory_is_raised_when_it_cannot_be_retried
# raises the same errors from MaxLength in process
@pytest.mark.slow
def test_out_of_memory_fails_the_run_when_it_cannot_back_off(tiny_dir, tmp_path):
    fixed = subprocess.run(
        torchrun_command(1, *arithmetic_run(tiny_dir), *BACKOFF_RUN, "actor.max_length_per_device=1024",
                         "actor.oom_backoff=false", f"trainer.output_dir={tmp_path / 'fixed'}")[0],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**torchrun_command(1)[1], "RL2GEM_SIMULATED_MEMORY_MIB": "100"},
    )  # fmt: skip
    assert fixed.returncode != 0 and "OutOfMemoryError" in fixed.stderr
    tiny = subprocess.run(  # 20 MiB: not even one sequence fits
        torchrun_command(1, *arithmetic_run(tiny_dir), *BACKOFF_RUN, "actor.max_length_per_device=128",
                         f"trainer.output_dir={tmp_path / 'tiny'}")[0],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**torchrun_command(1)[1], "RL2GEM_SIMULATED_MEMORY_MIB": "20"},
    )  # fmt: skip
    assert tiny.returncode != 0 and "a micro-batch holds one sequence" in tiny.stderr
    assert "nothing left to halve" in tiny.stderr


# slow: the back-off: test_out_of_memory_backs_off_...; the record: tests/training/test_autosize.py
@pytest.mark.slow
def test_two_ranks_record_the_halved_length_and_a_relaunch_resumes_with_it(tiny_dir, tmp_path):
    """With two ranks an out-of-memory error cannot be retried in place: the rank records half the
    largest micro-batch it planned and fails; a relaunch with trainer.resume=true plans with the
    recorded length and the step fits (60 MiB of activations: each rank's two sequences do not fit
    in one micro-batch, one does)."""
    out = tmp_path / "relaunches"
    cmd, env = torchrun_command(
        2,
        *arithmetic_run(tiny_dir),
        *BACKOFF_RUN,
        "actor.max_length_per_device=512",
        "trainer.resume=true",
        "trainer.save_every=1",
        f"trainer.output_dir={out}",
    )
    recorded = []
    for _ in range(4):
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=600,
            env={**env, "RL2GEM_SIMULATED_MEMORY_MIB": "60"},
        )
        if r.returncode == 0:
            break
        assert "OutOfMemoryError: out of memory at actor.max_length_per_device=" in r.stderr, r.stderr[-3000:]
        recorded.append(int((out / "max_length_per_device").read_text()))
    assert r.returncode == 0 and recorded and recorded == sorted(recorded, reverse=True)
    steps = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    assert [steps[s]["actor/max_length_per_device"] for s in (1, 2)] == [recorded[-1]] * 2
    # half the micro-batch that failed (a rank's two sequences, under 512 tokens), not half the
    # 512-token budget (which planned the same two-sequence micro-batch again: one wasted relaunch)
    assert len(recorded) == 1 and recorded[0] < 256
    assert (out / "checkpoint-2").exists()


def test_auto_length_fits_the_simulated_device_without_backing_off(tiny_dir, tmp_path):
    """max_length_per_device=auto probes the actor and the critic and plans a length that runs
    (a back-off would have halved it between the two steps, or failed the run with 2 ranks)."""
    out = tmp_path / "auto"
    torchrun(
        2,
        *arithmetic_run(tiny_dir),
        *BACKOFF_RUN,
        "actor.max_length_per_device=auto",
        f"trainer.output_dir={out}",
        env={"RL2GEM_SIMULATED_MEMORY_MIB": "150"},
    )
    steps = logged_steps(out / "metrics.jsonl", "actor/pg_loss")
    length = steps[1]["actor/max_length_per_device"]
    assert length % 64 == 0 and 64 <= length < 512 and steps[2]["actor/max_length_per_device"] == length
    assert not (out / "max_length_per_device").exists()


def test_a_step_whose_groups_dynamic_filtering_all_drops_is_skipped_not_repeated(tiny_dir, tmp_path):
    """The tiny random model never solves Countdown: with dynamic filtering every group (all
    rewards 0) is dropped, up to max_groups_factor x the groups asked for. Such a step counts, with
    no update, so the run ends (it looped on step 0 before)."""
    out = tmp_path / "run"
    torchrun(
        1,
        "trainers/ppo.py",
        "env=rl2/Countdown-v0",
        f"actor.model={tiny_dir}",
        "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=2",
        "rollout.max_new_tokens=4",
        "rollout.dynamic_filter=true",
        "trainer.total_steps=2",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        timeout=300,
    )
    steps = logged_steps(out / "metrics.jsonl", "rollout/filtered_ratio")
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["rollout/filtered_ratio"] == 1.0 and row["actor/skipped_step"] == 1.0
        assert row["rollout/groups_started"] == 8  # max_groups_factor 4 x 2 groups
        assert row["time/weight_sync"] >= 0  # the unchanged weights relabelled: the next rollout is on-policy


def test_scoring_frees_the_critic_s_bf16_copy_before_the_actor_trains(tiny_dir, tmp_path, monkeypatch):
    """bf16 compute with float32 masters at one rank: the critic is one FSDP unit, which keeps its
    bf16 copy after the scoring pass's no-grad forward. The update's actor passes come first, and
    ``auto`` planned their memory without that copy: scoring frees it (the critic's parameters are
    its float32 shards again when the update starts), and the critic still trains."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    update, seen = ppo.PPOTrainer.update, []

    def spy(self, *args):
        assert isinstance(self.critic.model, FSDPModule)
        seen.append({type(p) for p in self.critic.model.parameters()})
        return update(self, *args)

    monkeypatch.setattr(ppo.PPOTrainer, "update", spy)
    out = tmp_path / "bf16"
    options = ["actor.dtype=bfloat16", "adv.estimator=gae", "rollout.max_new_tokens=4", "critic.lr=1e-2"]
    options += ["reward.transform=tests.toy_envs:even_token_reward"]  # rewards the critic learns from
    run = [*arithmetic_run(tiny_dir)[1:], *options, "trainer.total_steps=2", "trainer.eval_at_start=false"]
    assert ppo.main([*run, "trainer.eval_n=0", f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    assert seen == [{DTensor}, {DTensor}]
    steps = logged_steps(out / "metrics.jsonl", "critic/grad_norm")
    assert steps[1]["critic/grad_norm"] > 0 and steps[2]["critic/values"] != 0.0


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_each_optimizer_step_s_loss_is_its_own_minibatch_s_mean(tiny_dir, tmp_path, monkeypatch, loss_agg):
    """``actor.minibatches_per_update=2`` over 4 sequences of different lengths: each optimizer
    step's token weights are its minibatch's mean, summing to 1 per step (verl's and OpenRLHF's
    normalisation), not the whole rollout's (which gave each step ``n_k / N``, an Adam step sized by
    its minibatch's token count)."""
    policy_loss, actor_step, sums = ppo.policy_loss, None, [0.0]

    def weighing(*args, token_weights, **kwargs):
        mask = args[3]
        sums[-1] += float((token_weights * mask).sum())
        return policy_loss(*args, token_weights=token_weights, **kwargs)

    def stepping(self, *args):
        sums.append(0.0)
        return actor_step(*args)

    update = ppo.PPOTrainer.update

    def updating(self, samples, *args):
        nonlocal actor_step
        actor_step = self.actor.step
        monkeypatch.setattr(self.actor, "step", lambda: stepping(self))
        lengths.append([sum(s.mask) for s in samples])
        return update(self, samples, *args)

    lengths = []
    monkeypatch.setattr(ppo, "policy_loss", weighing)
    monkeypatch.setattr(ppo.PPOTrainer, "update", updating)
    out = tmp_path / loss_agg
    options = ["actor.minibatches_per_update=2", "actor.old_logprobs=recompute", f"actor.loss_agg={loss_agg}"]
    options += ["rollout.max_new_tokens=16", "rollout.temperature=20.0", "trainer.total_steps=1"]
    run = [*arithmetic_run(tiny_dir)[1:], *options, "trainer.eval_at_start=false", "trainer.eval_n=0"]
    assert ppo.main([*run, f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    assert sums[-1] == 0.0 and len(sums) == 3  # two optimizer steps, nothing weighed after them
    assert sums[:2] == [pytest.approx(1.0, rel=1e-5)] * 2, (sums, lengths)


@pytest.mark.parametrize(("kind", "packing"), [("gspo", "flat"), ("gspo", "tree"), ("cispo", "flat")])
def test_each_policy_loss_in_the_trainer_equals_its_formula_per_sequence(
    tiny_dir, tmp_path, monkeypatch, kind, packing
):
    """``actor.policy_loss``: a packed micro-batch's loss is the sum of its sequences' terms,
    computed here per sample from the samples' lengths, on the second pass of a step, after the
    weights moved. GSPO: each sequence its own ratio over its own action tokens; CISPO: each
    token's clipped ratio, ``-A clip(r)``."""
    policy_loss, micro_batch_loss, lengths, seen = ppo.policy_loss, ppo.PPOTrainer.micro_batch_loss, [], []

    def recording(self, part, *args):
        lengths.append([len(sample) for sample in part])
        return micro_batch_loss(self, part, *args)

    def checking(logprobs, old, advantages, mask, *, token_weights, is_weights, clip_low, clip_high, **kwargs):
        sizes = lengths[-1]  # the tiny model earns no reward: a +-1 advantage per sequence instead
        advantages = torch.cat([torch.full((n,), (-1.0) ** i) for i, n in enumerate(sizes)])[None]
        loss, metrics = policy_loss(logprobs, old, advantages, mask, token_weights=token_weights,
                                    is_weights=is_weights, clip_low=clip_low, clip_high=clip_high, **kwargs)  # fmt: skip
        expected, ratios = 0.0, []
        rows = (
            t[0].detach().split(sizes) for t in (logprobs, old, advantages, mask.float(), token_weights, is_weights)
        )
        for lp, o, a, m, w, iw in zip(*rows, strict=True):
            if kwargs["kind"] == "gspo":
                ratio = torch.exp(((lp - o) * m).sum() / m.sum())
                term = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
            else:
                ratio = torch.exp(lp - o)
                term = -a * ratio.clamp(1 - clip_low, 1 + clip_high)
            expected += float((term * iw * w * m).sum())
            ratios.append(float((ratio * m).sum() / m.sum()))
        seen.append((kwargs["kind"], float(loss.detach()), expected, ratios))
        return loss, metrics

    monkeypatch.setattr(ppo.PPOTrainer, "micro_batch_loss", recording)
    monkeypatch.setattr(ppo, "policy_loss", checking)
    options = [f"actor.policy_loss={kind}", f"actor.packing={packing}", "actor.update_per_rollout=2", "actor.lr=1e-2"]
    options += [
        "actor.old_logprobs=recompute",
        "rollout.max_new_tokens=8",
        "rollout.temperature=20.0",
        "trainer.total_steps=1",
    ]
    run = [*arithmetic_run(tiny_dir)[1:], *options, "trainer.eval_at_start=false", "trainer.eval_n=0"]
    assert ppo.main([*run, f"trainer.output_dir={tmp_path}", "trainer.progress=false"]) == 0
    assert seen and all(seen_kind == kind for seen_kind, *_ in seen)
    for _, loss, expected, _ in seen:
        assert loss == pytest.approx(expected, rel=1e-4, abs=1e-7)
    second_pass = [ratio for *_, ratios in seen[len(seen) // 2 :] for ratio in ratios]
    assert max(abs(ratio - 1) for ratio in second_pass) > 1e-4  # the ratios moved: a real check
    assert len({round(ratio, 9) for ratio in second_pass}) > 1  # each sequence its own


def test_masked_share_dual_clip_and_approx_kl_are_logged_from_the_losses_tokens(tiny_dir, tmp_path, monkeypatch):
    """``actor/is_masked_ratio`` is the share of the step's action tokens MIS left out (here a
    fixed pattern: every third token kept), ``actor/approx_kl`` and ``actor/dual_clip_ratio`` the
    token-weighted means of what the loss measured (recorded per micro-batch here)."""
    importance_weights, policy_loss, seen = ppo.importance_weights, ppo.policy_loss, []

    def masking(old, rollout, mask, mode, cap):
        weights, _ = importance_weights(old, rollout, mask, mode, cap)
        kept = mask & (torch.arange(mask.shape[-1], device=mask.device) % 3 == 0)
        seen.append({"tokens": float(mask.sum()), "left_out": float((mask & ~kept).sum())})
        return weights, kept

    def recording(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        seen[-1].update(approx_kl=float(metrics["approx_kl"]), dual=float(metrics["dual_clip_ratio"]))
        return loss, metrics

    monkeypatch.setattr(ppo, "importance_weights", masking)
    monkeypatch.setattr(ppo, "policy_loss", recording)
    options = ["actor.is_mode=masked", "actor.dual_clip=1.5", "actor.update_per_rollout=2", "actor.lr=1e-2"]
    options += [
        "actor.old_logprobs=recompute",
        "rollout.max_new_tokens=8",
        "rollout.temperature=20.0",
        "actor.entropy_coef=0.05",
    ]
    run = [*arithmetic_run(tiny_dir)[1:], *options, "trainer.total_steps=1", "trainer.eval_at_start=false"]
    assert ppo.main([*run, "trainer.eval_n=0", f"trainer.output_dir={tmp_path}", "trainer.progress=false"]) == 0
    logged = logged_steps(tmp_path / "metrics.jsonl", "actor/pg_loss")[1]
    tokens = sum(row["tokens"] for row in seen)
    assert logged["actor/is_masked_ratio"] == pytest.approx(sum(row["left_out"] for row in seen) / tokens, rel=1e-5)
    for key, name in (("approx_kl", "actor/approx_kl"), ("dual", "actor/dual_clip_ratio")):
        expected = sum(row[key] * row["tokens"] for row in seen) / tokens
        assert logged[name] == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert logged["actor/approx_kl"] > 0  # the second pass moved away from the old log-probs


def test_dapo_s_overlong_shaping_in_the_trainer(tiny_dir, tmp_path):
    """The tiny model never stops within 4 tokens: every action is cut off. The soft punishment
    gives each episode -1 (the env's reward is 0). Filtering then leaves every sample out and the
    step is skipped; without it the entropy bonus moves the weights."""
    options = [
        "rollout.max_new_tokens=4",
        "rollout.temperature=20.0",
        "actor.entropy_coef=0.05",
        "trainer.total_steps=1",
    ]
    run = [
        *arithmetic_run(tiny_dir)[1:],
        *options,
        "trainer.eval_at_start=false",
        "trainer.eval_n=0",
        "trainer.progress=false",
    ]
    rows = {}
    for mask in ("false", "true"):
        out = tmp_path / mask
        overlong = ["reward.overlong.buffer=2", f"reward.overlong.mask={mask}"]
        assert ppo.main([*run, *overlong, f"trainer.output_dir={out}"]) == 0
        rows[mask] = logged_steps(out / "metrics.jsonl", "rollout/cut_off")[1]
    for row in rows.values():
        assert row["rollout/cut_off"] == 1.0 and row["rollout/overlong_penalty"] == -1.0
        assert row["rollout/reward"] == -1.0 and row["rollout/env_reward"] == 0.0
    assert rows["false"]["actor/grad_norm"] > 0 and "rollout/left_out_samples" not in rows["false"]
    # every sample left out: no update (a step of zero gradients logged an entropy of 0)
    assert rows["true"]["rollout/left_out_samples"] == 1.0 and rows["true"]["actor/skipped_step"] == 1.0
    assert "actor/grad_norm" not in rows["true"] and "actor/entropy" not in rows["true"]


def test_samples_left_out_by_overlong_filtering_leave_the_sequence_mean_s_count(tiny_dir, tmp_path, monkeypatch):
    """``reward.overlong.mask`` with a sequence mean (GSPO's ``seq_mean_token_mean``): the kept
    samples' weights sum to 1, as verl's sequence mean over the sequences with tokens. Left-out
    samples still counted in ``num_sequences``: the step's loss shrank by the share kept (0.5 here)."""
    from rl2gem.rewards.objectives import Overlong

    policy_loss, sums, calls = ppo.policy_loss, [], iter(range(10**6))
    monkeypatch.setattr(Overlong, "cut_off", staticmethod(lambda episode: next(calls) % 2 == 0))  # every other one

    def weighing(*args, token_weights, **kwargs):
        sums.append(float((token_weights * args[3]).sum()))
        return policy_loss(*args, token_weights=token_weights, **kwargs)

    monkeypatch.setattr(ppo, "policy_loss", weighing)
    options = ["reward.overlong.mask=true", "actor.loss_agg=seq_mean_token_mean", "actor.old_logprobs=recompute"]
    options += ["rollout.max_new_tokens=8", "trainer.total_steps=1", "trainer.eval_at_start=false", "trainer.eval_n=0"]
    out = tmp_path / "run"
    run = [*arithmetic_run(tiny_dir)[1:], *options, f"trainer.output_dir={out}", "trainer.progress=false"]
    assert ppo.main(run) == 0
    assert logged_steps(out / "metrics.jsonl", "rollout/left_out_samples")[1]["rollout/left_out_samples"] == 0.5
    assert sum(sums) == pytest.approx(1.0, rel=1e-5)


def rewriting_template(folder):
    """A ChatML template file with a blank line after every message but the last: every turn
    rewrites the one before, so each turn starts a new sequence."""
    template = folder / "rewriting.jinja"
    template.write_text(
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- if not loop.last -%}{{ '\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    return template


def test_a_critic_s_returns_run_across_an_episode_s_sequences(tiny_dir, tmp_path, monkeypatch):
    """GAE on multi-turn episodes under a template that rewrites earlier turns (every turn a new
    sequence): the critic's estimator sees each episode whole, in one call over the step's
    samples, so the returns of an episode's first turns include its later rewards."""
    template = rewriting_template(tmp_path)
    estimate, calls = ppo.apply_critic_estimator, []

    def recording(samples, *args, **kwargs):
        calls.append([(s.episode, s.sequence) for s in samples])
        return estimate(samples, *args, **kwargs)

    monkeypatch.setattr(ppo, "apply_critic_estimator", recording)
    out = tmp_path / "split"
    options = ["env=rl2/GuessTheNumber-Easy-v0", f"actor.model={tiny_dir}", f"rollout.chat_template={template}"]
    options += ["rollout.prompts_per_rollout=2", "rollout.responses_per_prompt=2", "rollout.max_new_tokens=8"]
    options += ["adv.estimator=gae", "reward.transform=tests.toy_envs:even_token_reward", "trainer.total_steps=1"]
    options += ["trainer.eval_at_start=false", "trainer.eval_n=0", "actor.max_length_per_device=128"]  # a sequence each
    assert ppo.main([*options, f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    assert len(calls) == 1  # one call over the step, not one per micro-batch (one sequence each)
    episodes = {}
    for episode, sequence in calls[0]:
        episodes.setdefault(episode, []).append(sequence)
    assert len(episodes) == 4 and all(sorted(s) == list(range(len(s))) and len(s) > 1 for s in episodes.values())
    steps = logged_steps(out / "metrics.jsonl", "critic/grad_norm")
    assert steps[1]["rollout/splits"] > 0 and steps[1]["critic/grad_norm"] > 0


def test_two_ranks_gather_the_critic_s_inputs_of_split_episodes(tiny_dir, tmp_path):
    """The same with two ranks: an episode's sequences sit in micro-batches of either rank, whose
    values, old log-probs and rewards every rank gathers before the estimator runs over the step."""
    template = rewriting_template(tmp_path)
    out = tmp_path / "two"
    torchrun(
        2,
        "trainers/ppo.py",
        "env=rl2/GuessTheNumber-Easy-v0",
        f"actor.model={tiny_dir}",
        f"rollout.chat_template={template}",
        "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=2",
        "rollout.max_new_tokens=8",
        "adv.estimator=gae",
        "reward.transform=tests.toy_envs:even_token_reward",
        "actor.max_length_per_device=128",
        "trainer.total_steps=2",
        "trainer.eval_at_start=false",
        "trainer.eval_n=0",
        f"trainer.output_dir={out}",
        "trainer.progress=false",
    )
    steps = logged_steps(out / "metrics.jsonl", "critic/grad_norm")
    assert all(steps[s]["rollout/splits"] > 0 and steps[s]["critic/grad_norm"] > 0 for s in (1, 2))
