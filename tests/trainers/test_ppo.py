"""The PPO trainer: config errors, FSDP2 equivalence over 2 ranks, a 2-step 2-rank smoke run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def torchrun(nproc, *args, timeout=600, cwd=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_unknown_config_key_names_the_closest():
    r = subprocess.run([sys.executable, "-m", "rl2gem.trainers.ppo", "actor.lrr=1e-5"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "did you mean 'actor.lr'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rl2gem.trainers.ppo", "adv"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "key=value" in r.stderr


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny import tiny_model
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    d = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(d)
    AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")).save_pretrained(d)
    return d


def test_fsdp_two_ranks_equal_one(tiny_dir, tmp_path):
    script = str(ROOT / "tests" / "parallel" / "fsdp_equivalence.py")
    torchrun(1, script, str(tiny_dir), str(tmp_path / "one.json"))
    torchrun(2, script, str(tiny_dir), str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-7)
    assert one["params"] == pytest.approx(two["params"], rel=1e-6)
    for name, g in one["grads"].items():
        assert g == pytest.approx(two["grads"][name], rel=1e-4, abs=1e-7), name


def test_two_rank_smoke_run_logs_evaluates_and_exports(tiny_dir, tmp_path):
    out = tmp_path / "run"
    stdout = torchrun(
        2, "trainers/ppo.py", "env=rl2/Countdown-v0", f"actor.model={tiny_dir}", "rollout.prompts_per_rollout=2",
        "rollout.responses_per_prompt=2", "rollout.max_new_tokens=8", "trainer.total_steps=2", "trainer.eval_n=4",
        f"trainer.output_dir={out}", "trainer.progress=false", "kl.coef=0.01",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("rollout/reward", "rollout/response_length", "actor/kl", "actor/clip_ratio", "actor/entropy", "actor/grad_norm",
                "perf/tokens_per_second", "perf/mfu", "time/rollout"):
        assert key in steps[0], key
    assert any("eval/success" in r for r in rows)
    assert (out / "curves.png").stat().st_size > 1000 and (out / "config.yaml").exists()
    assert "final eval" in stdout
    from transformers import AutoModelForCausalLM

    hf = out / "checkpoint-2" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.num_hidden_layers == 2
