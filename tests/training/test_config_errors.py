"""A bad config value stops every trainer before anything loads, with one line naming the key."""

import errno
import functools
import os
import socket
import subprocess
import sys
from unittest import mock

import pytest
from helpers import ROOT
from omegaconf import OmegaConf
from rl2gem.trainers import dpo, ppo, rm, sft

from rl2gem.config import load_config
from rl2gem.data import missing_data_files
from rl2gem.training.trainer import OutputDirInUse, check_common_keys, hold_output_dir, launch


class MustNotBuild:
    """A trainer whose construction fails the test: nothing may load before the config is checked."""

    def __init__(self, cfg):
        raise AssertionError(f"the trainer was built with a bad config: {cfg}")


CASES = [
    ("actor.lr=abc", "config error: actor.lr: expected a float, got 'abc'"),
    ("rollout.responses_per_prompt=0", "config error: rollout.responses_per_prompt: must be >= 1, got 0"),
    ("trainer.total_steps=-1", "config error: trainer.total_steps: must be >= 0, got -1"),
    ("trainer.keep_checkpoints=-2", "config error: trainer.keep_checkpoints: must be >= 0, got -2"),
    ("config=no_such_recipe", "config error: config=no_such_recipe: no such recipe file"),
    ("env=rl2/NoSuchEnv-v0", "config error: env: Environment `NoSuchEnv` doesn't exist in namespace rl2"),
    ("actor.model=/no/such/model", "config error: actor.model: no such model folder '/no/such/model'"),
    ("rollout.is_mode=masked", "config error: rollout.is_mode: moved to actor.is_mode"),
    ("actor.dtype=half", "config error: actor.dtype must be auto or one of"),
    ("actor.master_dtype=half", "config error: actor.master_dtype must be auto or one of"),
    ("actor.compile=maybe", "config error: actor.compile: expected true, false or auto, got 'maybe'"),
    ("actor.max_length_per_device=big", "config error: actor.max_length_per_device: expected a positive int or auto"),
    ("actor.max_length_per_device=0", "config error: actor.max_length_per_device: expected a positive int or auto"),
    (
        "actor.cpu_max_length_per_device=auto",
        "config error: actor.cpu_max_length_per_device: expected a positive int or null",
    ),
    (
        "actor.cpu_max_length_per_device=-5",
        "config error: actor.cpu_max_length_per_device: expected a positive int or null",
    ),
    (
        "actor.dtype=float32 actor.master_dtype=bfloat16",
        "config error: actor.master_dtype=bfloat16 is less precise than the compute dtype torch.float32",
    ),
    (
        "env=rl2/Math-v0 env_kwargs.dataset=/no/such/data.jsonl",
        "config error: env_kwargs.dataset: no such data file '/no/such/data.jsonl'",
    ),
    # values the trainer reads only once its models are loaded: checked first now
    ("actor.max_grad_norm=-1", "config error: actor.max_grad_norm: expected a number > 0, got -1"),
    ("actor.lr=-1e-5", "config error: actor.lr: expected a number > 0, got -1e-05"),
    ("critic.lr=0", "config error: critic.lr: expected a number > 0, got 0"),
    ("actor.scheduler=bogus", "config error: actor.scheduler: expected one of ['constant', 'linear', 'cosine']"),
    ("actor.lora.dropout=1.5", "config error: actor.lora.dropout: expected a number in [0, 1), got 1.5"),
    (
        "actor.lora.rank=4 actor.lora.target_modules=q_proj,v_proj",
        "config error: actor.lora.target_modules: a list is written [q_proj,v_proj], got the one name 'q_proj,v_proj'",
    ),
    (
        "actor.lora.rank=4 actor.lora.target_modules=[lm_head]",
        "config error: actor.lora.target_modules: ['lm_head'] cannot be adapted here",
    ),
    (
        "actor.lora.rank=4 actor.tp_size=2",
        "config error: actor.lora.rank: LoRA with tp_size=2 is not supported",
    ),
    (
        "actor.lora.target_modules=[]",
        "config error: actor.lora.target_modules: expected all-linear or a non-empty list of module names, got []",
    ),
    ("actor.ddp_size=0", "config error: actor.ddp_size: expected an int >= 1, got 0"),
    ("actor.is_mode=bogus", "config error: actor.is_mode='bogus' is not one of ['none', 'truncated', 'masked']"),
    ("actor.loss_agg=bogus", "config error: actor.loss_agg='bogus' is not one of ['token_mean'"),
    ("actor.dual_clip=0.5", "config error: actor.dual_clip=0.5 must be null or a number > 1"),
    ("kl.coef=-0.1", "config error: kl.coef=-0.1 must be a number >= 0"),
    ("actor.clip_low=1.5", "config error: actor.clip_low=1.5 must be <= 1"),
    ("adv.gamma=1.5", "config error: adv.gamma=1.5 must be a number in [0, 1]"),
    ("adv.lam=-0.1", "config error: adv.lam=-0.1 must be a number in [0, 1]"),
    (
        "adv.estimator=vtrace adv.vtrace.rho_bar=0.5",
        "config error: adv.vtrace: V-trace needs rho_bar >= c_bar > 0 (Espeholt et al. 2018), got rho_bar=0.5, c_bar=1.0",
    ),
    ("rollout.temperature=0", "config error: rollout.temperature=0: greedy rollouts are not samples of the policy"),
    ("actor.policy_loss=grpo", "config error: actor.policy_loss='grpo' is not one of ['ppo', 'gspo', 'cispo']"),
    (
        "actor.policy_loss=cispo actor.dual_clip=3",
        "config error: actor.dual_clip=3 is not a part of actor.policy_loss=cispo (set it to null)",
    ),
    ("actor.clip_high=-0.1", "config error: actor.clip_high=-0.1 must be a number >= 0"),
    ("actor.update_per_rollout=0", "config error: actor.update_per_rollout=0 must be >= 1"),
    (
        "actor.tp_size=2",
        "config error: actor.ddp_size * actor.sp_size * actor.tp_size = 1 * 1 * 2 does not divide the world size 1",
    ),
    ("kl.estimator=k9", "config error: kl.estimator='k9' is not one of ['k1', 'k2', 'k3']"),
    ("rollout.concurrency=0", "config error: rollout.concurrency must be an int >= 1, got 0"),  # it hung
    ("rollout.top_p=1.5", "config error: rollout.top_p must be in (0, 1], got 1.5"),
    ("rollout.max_new_tokens=0", "config error: rollout.max_new_tokens must be an int >= 1, got 0"),
    ("rollout.prompts_per_rollout=0", "config error: rollout.prompts_per_rollout=0 must be >= 1"),
    ("rollout.context.policy=bogus", "config error: rollout.context.policy must be one of ('truncate', 'summarize')"),
    ("trainer.save_every=-1", "config error: trainer.save_every: must be >= 0, got -1"),
    ("trainer.loggers=jsonl", "config error: trainer.loggers: expected a list of ['stdout', 'jsonl', 'wandb'"),
    ("trainer.loggers=[jsonl,wandbb]", "config error: trainer.loggers: expected a list of"),
    ("actor.lr=null", "config error: actor.lr: expected a float, got null"),
    ("env_kwargs=5", "config error: env_kwargs: expected a mapping (env_kwargs.KEY=VALUE), got 5"),
    ("trainer.loggers=[stdout", "config error: trainer.loggers=[stdout: not a value OmegaConf reads"),
    ("actor.lr=${oops}", "config error: actor.lr: Interpolation key 'oops' not found"),
    (
        "reward.model=smollm2-135m-instruct rollout.dynamic_filter=true",
        "config error: rollout.dynamic_filter=true compares each group's rewards as it finishes, before reward.model",
    ),
]


@pytest.mark.parametrize(("argument", "line"), CASES)
def test_ppo_refuses_a_bad_value_before_building_anything(argument, line, capsys):
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, argument.split()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


def test_a_model_that_tensor_parallelism_cannot_split_is_refused_before_it_loads(tiny_dir, monkeypatch, capsys):
    """The tiny model has 2 key/value heads: 4 ranks cannot split them. It was a traceback from
    every rank once the process group and the model were up."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    arguments = [f"actor.model={tiny_dir}", "actor.tp_size=4", "rollout.prompts_per_rollout=4"]
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, arguments) == 2
    line = "config error: actor.tp_size=4 does not divide the model's num_key_value_heads=2"
    assert capsys.readouterr().err.strip() == line


def test_groups_that_do_not_split_over_the_ranks_are_refused_before_the_process_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, ["rollout.prompts_per_rollout=3"]) == 2
    line = "config error: rollout.prompts_per_rollout=3 must be a multiple of the world size 2"
    assert capsys.readouterr().err.strip() == line


@pytest.mark.parametrize("trainer", [sft, rm, dpo])
def test_every_trainer_checks_types_models_and_data_files(trainer, capsys):
    missing_data = (
        "data.train=/no/such/rows.jsonl",
        "config error: data.train: no such data file '/no/such/rows.jsonl'",
    )
    model = next(case for case in CASES if case[0].startswith("actor.model="))
    for argument, line in [CASES[0], model, missing_data]:
        assert launch(MustNotBuild, trainer.CONFIG, trainer.check_config, [argument]) == 2
        assert capsys.readouterr().err.strip().startswith(line)


@pytest.mark.parametrize("trainer", [sft, rm, dpo])
def test_every_trainer_checks_the_eval_env_and_its_workers_values(trainer, capsys, tmp_path):
    """A typo'd trainer.eval_env failed at the final evaluation, before the final checkpoint (the
    run was lost); DPO's frozen ref.model was loaded unchecked; a null or string step count failed
    after loading."""
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    cases = [
        ("actor.lr=0", "config error: actor.lr: expected a number > 0, got 0"),
        ("trainer.total_steps=abc", "config error: trainer.total_steps: expected an int >= 0, got 'abc'"),
        ("data.batch_size=null", "config error: data.batch_size: expected an int, got null"),
    ]
    if trainer is not rm:  # RM evaluates on its test pairs only
        cases.append(("trainer.eval_env=rl2/NoSuch-v0", "config error: trainer.eval_env: Environment `NoSuch`"))
    if trainer is dpo:
        cases.append(("ref.model=/no/such/model", "config error: ref.model: no such model folder '/no/such/model'"))
    for argument, line in cases:
        assert launch(MustNotBuild, trainer.CONFIG, trainer.check_config, [argument, f"data.train={data}"]) == 2
        assert capsys.readouterr().err.strip().startswith(line), argument


def test_every_rank_stops_and_only_rank_0_says_why(monkeypatch, capsys):
    """Rank 0 says why and exits 2; another rank stops as well (nothing built) but exits 0 at once,
    so that torchrun, which stops every rank when one fails, never cuts rank 0 off before its line."""
    monkeypatch.setenv("RANK", "1")
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, ["actor.lr=abc"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, ["actor.lr=abc"]) == 2
    assert capsys.readouterr().err == "config error: actor.lr: expected a float, got 'abc'\n"


def test_under_torchrun_the_error_is_one_line_and_no_model_is_fetched(tmp_path):
    """The README's command with a typo'd value on two ranks: exit non-zero, the line once, an
    untouched model cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "RL2GEM_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run(
        [*command, str(ROOT / "trainers" / "ppo.py"), "actor.lr=abc"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0
    assert r.stderr.count("config error:") == 1  # both ranks stopped, one said why
    assert "config error: actor.lr: expected a float, got 'abc'" in r.stderr
    assert "Traceback" not in r.stderr.split("config error")[0]  # nothing failed before the check
    assert list(cache.iterdir()) == []  # no model (nor data) was fetched or converted


def test_missing_data_files_are_found_anywhere_in_a_section(tmp_path):
    present = tmp_path / "present.jsonl"
    present.write_text("{}\n")
    section = OmegaConf.create(
        {"dataset": "gsm8k", "files": {"train": "/x/a.jsonl", "test": str(present)}, "more": ["/y/b.csv", "org/name"]}
    )
    assert missing_data_files(section, "env_kwargs") == [
        ("env_kwargs.files.train", "/x/a.jsonl"),
        ("env_kwargs.more.0", "/y/b.csv"),
    ]
    assert missing_data_files(None, "data") == [] and missing_data_files("math500", "env_kwargs.dataset") == []


@pytest.mark.parametrize("argument", ["--help", "help=true"])
def test_help_prints_every_key_with_its_default_and_the_recipes(argument, capsys):
    with pytest.raises(SystemExit) as stop:
        launch(MustNotBuild, ppo.CONFIG, ppo.check_config, [argument, "actor.lr=abc"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "usage: [config=<recipe>] [key=value ...]" in out
    assert ppo.CONFIG.read_text().rstrip() in out  # every key, its default and its comment
    assert out.rstrip().endswith(
        "recipes (config=<name>): arithmetic, guess, guess_hard, multihop, multihop_summarize, multihop_truncate, searchqa"
    )


def test_each_trainers_help_lists_its_own_recipes_only(capsys):
    """A recipe named for a trainer (``guess_sft``) is that trainer's: DPO's help listed the SFT
    recipes, whose keys DPO's defaults also have."""
    from rl2gem.trainers import dpo, rm, sft

    expected = {
        sft: "guess_hard_sft, guess_sft, multihop_sft, searchqa_sft",
        dpo: "arithmetic_dpo",
        rm: "arithmetic_rm",
    }
    for trainer, recipes in expected.items():
        with pytest.raises(SystemExit):
            launch(MustNotBuild, trainer.CONFIG, trainer.check_config, ["--help"])
        assert capsys.readouterr().out.rstrip().endswith(f"recipes (config=<name>): {recipes}"), trainer


def test_documented_nulls_pass_the_check():
    """null turns the value clip off and gives a LoRA setting its default: the check refused both."""
    arguments = ["adv.estimator=gae", "critic.value_clip=null", "actor.lora.rank=4", "actor.lora.alpha=null"]
    cfg = load_config(ppo.CONFIG, arguments)
    check_common_keys(cfg)
    ppo.check_config(cfg)
    assert cfg.critic.value_clip is None and cfg.actor.lora.alpha is None


def test_gspo_with_ppos_clip_range_is_warned_about_and_the_papers_is_not():
    import warnings

    with pytest.warns(UserWarning, match="actor.policy_loss=gspo with actor.clip_low=0.2, actor.clip_high=0.28"):
        ppo.check_config(load_config(ppo.CONFIG, ["actor.policy_loss=gspo"]))
    papers = ["actor.policy_loss=gspo", "actor.clip_low=3e-4", "actor.clip_high=4e-4"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ppo.check_config(load_config(ppo.CONFIG, papers))
        ppo.check_config(load_config(ppo.CONFIG, ["actor.policy_loss=cispo"]))
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []


@pytest.mark.parametrize(
    "arguments, warned",
    [
        (["kl.coef=0.1", "kl.estimator=k1"], "kl.estimator=k1 as a loss term"),
        (["kl.coef=0.1", "kl.estimator=k2"], None),
        (["kl.coef=0.1", "kl.estimator=k1", "kl.in_reward=true", "adv.estimator=gae"], None),
        (["rollout.top_p=0.9"], "rollout.top_p=0.9: the engine's log-probs"),
    ],
)
def test_settings_the_policy_gradient_does_not_see_are_warned_about(arguments, warned):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ppo.check_config(load_config(ppo.CONFIG, arguments))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert [m for m in messages if warned and m.startswith(warned)] if warned else messages == [], messages


def test_a_second_run_on_a_folder_in_use_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    """Two runs writing one ``trainer.output_dir`` interleave their checkpoints and metrics. The
    folder's lock is held for the run, refused to a second run (naming the holder), and free again
    once its holder is gone, even killed."""
    from rl2gem.training import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "hold_output_dir", functools.partial(hold_output_dir, wait_seconds=0.5))
    folder = tmp_path / "run"
    held = hold_output_dir(folder)
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, [f"trainer.output_dir={folder}"]) == 2
    holder = f"{os.getpid()}@{socket.gethostname()}"
    assert f"error: trainer.output_dir={folder} is being written by another run (pid {holder})" in (
        capsys.readouterr().err
    )
    held.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; from rl2gem.training.trainer import hold_output_dir; "
         f"held = hold_output_dir(__import__('pathlib').Path({str(folder)!r})); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputDirInUse, match=f"pid {holder.pid}"):
        hold_output_dir(folder, wait_seconds=0.2)
    holder.kill()
    holder.wait()
    hold_output_dir(folder, wait_seconds=0).close()  # a killed holder's lock is gone at once

    def no_flock(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(trainer_module.fcntl, "flock", no_flock)  # Lustre noflock, some NFS mounts
    with pytest.warns(UserWarning, match="not locked out"):
        hold_output_dir(folder).close()


def test_a_model_of_the_wrong_kind_is_refused_before_anything_loads(tiny_dir, tmp_path, capsys):
    """A policy's folder given as ``reward.model`` failed after the actor loaded (a traceback); a
    reward model's given as ``actor.model`` loaded as a causal LM."""
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, [f"reward.model={tiny_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"config error: reward.model: {tiny_dir} is a LlamaForCausalLM, not a reward model (a one-label sequence "
        "classifier, such as a trainers/rm.py run folder)"
    )
    reward_model = tmp_path / "rm"
    reward_model.mkdir()
    (reward_model / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    for trainer in (ppo, sft, dpo):
        assert launch(MustNotBuild, trainer.CONFIG, trainer.check_config, [f"actor.model={reward_model}"]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err
            == f"config error: actor.model: {reward_model} is a LlamaForSequenceClassification, not a causal language model"
        )


def test_rows_that_do_not_fit_the_trainer_are_one_line_before_any_model_loads(tiny_dir, tmp_path, capsys):
    """Preference pairs given to SFT: the message was clear, but inside a traceback."""
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text('{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}\n')
    arguments = [f"data.train={pairs_file}", f"actor.model={tiny_dir}", f"trainer.output_dir={tmp_path / 'run'}"]
    with mock.patch("rl2gem.training.offline.Worker", MustNotBuild):
        assert sft.main(arguments) == 2
    err = capsys.readouterr().err
    assert err.startswith("data error: ") and err.count("\n") == 1, err
