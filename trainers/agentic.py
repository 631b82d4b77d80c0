"""The agentic pipeline of an env, stage by stage and resumable: oracle episodes -> SFT -> PPO on
multi-turn rollouts -> evaluation of the base, SFT-only and SFT+RL models on held-out items.
Pipelines: ``searchqa`` (rl2/SearchQA-v0), ``guess`` and ``guess-hard`` (rl2/GuessTheNumber-v0) and ``multihop``
(rl2/MultiHopQA-v0: two searches per question), also with its history managed in 512-token
segments (``multihop-truncate``, ``multihop-summarize``; ``rollout.context``).

    python -m rl2gem.trainers.agentic searchqa          # the full run (README, "Agentic training")
    python -m rl2gem.trainers.agentic searchqa --toy    # a few items and one step per stage (CI)
    python -m rl2gem.trainers.agentic guess             # the second env
    python -m rl2gem.trainers.agentic multihop-summarize --sft-from runs/agentic-multihop --eval-models sft,sft+rl

Stages (each a child process; ``--stages`` runs a subset):

1. ``collect``: the env's scripted solver plays the train split (``python -m rl2gem.collect``).
2. ``sft``: ``trainers/sft.py`` on those episodes (the recipe ``trainers/config/<env>_sft.yaml``).
3. ``ppo``: ``trainers/ppo.py`` from the SFT model (the recipe ``trainers/config/<env>.yaml``):
   multi-turn token-in/token-out rollouts, env tokens masked, turns prefix-merged.
4. ``eval``: ``python -m rl2gem.evaluate`` of each model on the same held-out items (greedy).
5. ``table``: ``<out>/results.md`` (one row per model: reward, success, EM / F1, searches and the
   share of episodes with two or more where the env reports them, turns, invalid actions,
   generated tokens, and the tokens prefix merging saved against re-rendering each turn as a new
   prompt; then each model against the previous one on the same items: items gained and lost and
   the sign test's p, :func:`rl2gem.evaluation.paired_comparison`; ``agentic_report``) and ``<out>/results.png``.

``--sft-from DIR`` takes the SFT model of another pipeline's run folder (its ``sft`` stage must be
done) and skips ``collect`` and ``sft``: the context-managed multihop runs start from the model of
the ``multihop`` run, so that the policies compare at equal steps from one starting point.
``--eval-models sft,sft+rl`` leaves out the base model's evaluation (there, 0.000 EM in 14 minutes
of the 2 cores: it never searches in the tags the env reads).

Resuming: a stage whose output is complete is skipped (collect and eval write to a temporary file
renamed at the end; SFT and PPO write ``<out>/<stage>/DONE`` when they exit cleanly), and an
interrupted SFT or PPO stage continues from its last checkpoint (``trainer.resume=true``). So the
same command, run again after a crash, picks up where it stopped. Only a finished stage (``DONE``)
feeds the next: ``DONE`` records the model the stage started from (with that stage's run id), and a
finished stage whose input has changed since (SFT trained again, another ``--base``) is refused
with a message naming the folder to remove; an evaluation of another model than its file's
(``eval/<label>.model``) is run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rl2gem.trainers.agentic_report import table

from rl2gem.parallel.fsdp import ranks_per_node
from rl2gem.procs import run_main

__all__ = ["PIPELINES", "Pipeline", "main"]

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Pipeline:
    """One env's pipeline.

    Attributes:
        env: the env id.
        collect: ``key=value`` arguments of ``python -m rl2gem.collect`` (the solver's episodes).
        sft_config / ppo_config: recipe names in ``trainers/config``.
        eval: ``key=value`` arguments of ``python -m rl2gem.evaluate`` shared by every model.
        toy: overrides for ``--toy`` per stage (``collect``, ``sft``, ``ppo``, ``eval``).
    """

    env: str
    collect: list[str]
    sft_config: str
    ppo_config: str
    eval: list[str]
    toy: dict[str, list[str]] = field(default_factory=dict)


_TOY_TRAIN = ["trainer.total_steps=1", "trainer.eval_at_start=false", "trainer.eval_n=2", "trainer.progress=false"]


def _toy(env_kwargs: dict[str, str] | None = None) -> dict[str, list[str]]:
    """``--toy`` overrides per stage: 16 solver episodes, one SFT and one PPO step on 2 x 2 episodes,
    2 evaluation episodes per model; ``env_kwargs`` set in every stage."""
    kwargs = [f"env_kwargs.{k}={v}" for k, v in (env_kwargs or {}).items()]
    eval_kwargs = [f"trainer.eval_env_kwargs.{k}={v}" for k, v in (env_kwargs or {}).items()]
    return {
        "collect": ["n=16", *kwargs],
        "sft": [*_TOY_TRAIN, "data.batch_size=4", *eval_kwargs],
        "ppo": [*_TOY_TRAIN, "rollout.prompts_per_rollout=2", "rollout.responses_per_prompt=2", *kwargs],
        "eval": ["n=2", *kwargs],
    }


def _toy_multihop(context: bool) -> dict[str, list[str]]:
    """:func:`_toy` for a multihop pipeline: the PPO step updates (no dynamic filtering: the tiny
    test model's groups all score 0) and, with a context policy, segments of 256 tokens, so that
    the toy rollouts do start new segments."""
    toy = _toy()
    toy["ppo"] = [*toy["ppo"], "rollout.dynamic_filter=false", *(["rollout.context.max_tokens=256"] if context else [])]
    toy["eval"] = [*toy["eval"], *(["context.max_tokens=256"] if context else [])]
    return toy


PIPELINES: dict[str, Pipeline] = {
    "searchqa": Pipeline(
        env="rl2/SearchQA-v0",
        collect=["n=5000", "env_kwargs.topk=1"],
        sft_config="searchqa_sft",
        ppo_config="searchqa",
        eval=["n=200", "env_kwargs.topk=3", "env_kwargs.max_turns=4", "max_new_tokens=48", "batch_size=32"],
        toy=_toy(),
    ),
    "guess": Pipeline(
        env="rl2/GuessTheNumber-v0",
        collect=["n=2000", "env_kwargs.difficulty=expert"],
        sft_config="guess_sft",
        ppo_config="guess",
        eval=["n=200", "seed=100000", "env_kwargs.difficulty=expert", "max_new_tokens=16", "batch_size=64"],
        toy=_toy({"difficulty": "easy"}),  # 1..10 in 4 guesses: a toy run checks the stages, not the game
    ),
    **{
        name: Pipeline(
            env="rl2/MultiHopQA-v0",
            collect=["n=2000", "env_kwargs.topk=3"],
            sft_config="multihop_sft",
            ppo_config=name.replace("-", "_"),
            eval=[
                "n=200",
                "env_kwargs.topk=3",
                "env_kwargs.max_turns=5",
                "max_new_tokens=48",
                "batch_size=32",
                *context,
            ],
            toy=_toy_multihop(bool(context)),
        )
        for name, context in (
            ("multihop", []),
            ("multihop-truncate", ["context.max_tokens=512", "context.policy=truncate"]),
            (
                "multihop-summarize",
                ["context.max_tokens=512", "context.policy=summarize", "context.summary_max_new_tokens=96"],
            ),
        )
    },
    "guess-hard": Pipeline(  # few demonstrations: 64 solver games, so SFT stops well below the solver
        env="rl2/GuessTheNumber-v0",
        collect=["n=64", "env_kwargs.difficulty=hard"],
        sft_config="guess_hard_sft",
        ppo_config="guess_hard",
        eval=["n=200", "seed=100000", "env_kwargs.difficulty=hard", "max_new_tokens=16", "batch_size=64"],
        toy=_toy({"difficulty": "easy"}),
    ),
}


def _run(cmd: list[str], log: Path, threads: int = 1) -> None:
    """Run one stage's command, its output appended to ``log``, with ``threads`` intra-op threads per
    process (1 for torchrun's ranks, one per core; :func:`_one_process_threads` for a one-process
    stage).

    Raises:
        SystemExit: the stage failed (the log's last lines in the message).
    """
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    with open(log, "a") as sink:
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=environment)
    if r.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"stage failed (exit {r.returncode}); the last lines of {log}:\n{tail}")


def _one_process_threads() -> int:
    """Intra-op threads of a one-process stage: ``OMP_NUM_THREADS`` where it is set (the test suite's
    workers set 1: more threads than free cores make OpenMP spin, an evaluation of 2 episodes took
    76 s with 2 threads on 2 busy cores and 14 s with 1), else one per core."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def _torchrun(script: str, args: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def _checkpoint_hf(run_dir: Path) -> Path:
    return run_dir / (run_dir / "latest").read_text().strip() / "hf"


def _model_id(model: str) -> str:
    """``model`` as the records name it: a stage's export (``<stage>/checkpoint-N/hf``) by the id
    its ``DONE`` file got (a stage trained again writes the same paths; a moved run folder keeps its
    ids), anything else (a base model's name or folder) as given."""
    done = Path(model).parent.parent / "DONE"
    try:
        run_id = json.loads(done.read_text()).get("id") if Path(model).is_dir() and done.exists() else None
    except (ValueError, AttributeError):
        run_id = None
    return f"run {run_id}" if run_id else model


def _finished(run_dir: Path, source: str | None) -> Path | None:
    """The final Hugging Face export of a finished trainer stage (its ``DONE`` file written), or
    ``None`` if it has not finished: an interrupted stage's checkpoint is never another stage's input.

    ``DONE`` records the model the stage started from; ``source`` (when known) must be that one.

    Raises:
        SystemExit: the stage finished from another model than ``source`` (an SFT stage run again
            since, or another ``--base``): its results would not follow from the stages before.
    """
    done = run_dir / "DONE"
    if not done.exists():
        return None
    try:
        started = json.loads(done.read_text()).get("from")
    except (ValueError, AttributeError):
        started = None  # an older run's DONE: a time stamp only
    if source is not None and started is not None and started != _model_id(source):
        raise SystemExit(
            f"{run_dir} was trained from {started}, but its input is now {_model_id(source)} ({source}): "
            f"remove {run_dir} (or use another --out) to train it again"
        )
    return _checkpoint_hf(run_dir)


def _trained(stage: str, config: str, run_dir: Path, source: str, extra: list[str], nproc: int, log: Path) -> Path:
    """Run (or resume) a trainer stage from the model ``source``; returns its final Hugging Face
    export. ``DONE`` (with ``source`` in it) is written once the trainer exits cleanly.

    Raises:
        SystemExit: the stage failed, or finished earlier from another model (:func:`_finished`).
    """
    finished = _finished(run_dir, source)
    if finished is not None:
        return finished
    args = [f"config={config}", f"trainer.output_dir={run_dir}", "trainer.resume=true", f"actor.model={source}"]
    _run(_torchrun(str(ROOT / f"{stage}.py"), [*args, *extra], nproc), log)
    record = {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "id": uuid.uuid4().hex, "from": _model_id(source)}
    (run_dir / "DONE").write_text(json.dumps(record) + "\n")
    return _checkpoint_hf(run_dir)


def _evaluate(pipe: Pipeline, label: str, model: str, out: Path, extra: list[str]) -> Path:
    """``eval/<label>.jsonl``: ``model``'s evaluation, run unless that file holds one of this very
    model (``eval/<label>.model`` names it; a file of another model is evaluated again)."""
    path = out / "eval" / f"{label}.jsonl"
    record, model_id = path.with_suffix(".model"), _model_id(model)
    if path.exists() and record.exists() and record.read_text().strip() != model_id:
        print(f"{path} evaluated {record.read_text().strip()}; evaluating {model_id}", flush=True)
        path.unlink()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        args = [
            f"env={pipe.env}",
            f"model={model}",
            "split=test",
            *pipe.eval,
            *extra,
            f"output={tmp}",
            "progress=false",
        ]
        _run([sys.executable, "-m", "rl2gem.evaluate", *args], out / "eval" / f"{label}.log", _one_process_threads())
        record.write_text(model_id + "\n")
        tmp.rename(path)
    return path


#: The pipeline's stages, in the order they run.
STAGES = ("collect", "sft", "ppo", "eval", "table")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl2gem.trainers.agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("env", choices=sorted(PIPELINES))
    p.add_argument("--out", default=None, help="run folder (default runs/agentic-<env>[-toy])")
    p.add_argument("--toy", action="store_true", help="a few items and one step per stage (CI)")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument(
        "--nproc",
        default="auto",
        help="ranks of the SFT and PPO stages: auto (2, or 1 on a one-GPU machine) or a number",
    )
    p.add_argument("--base", default="smollm2-135m-instruct", help="the base model")
    p.add_argument("--sft-from", default=None, help="reuse the SFT model of this run folder (skips collect, sft)")
    p.add_argument(
        "--eval-models", default="base,sft,sft+rl", help="the models the eval stage evaluates (comma-separated)"
    )
    args = p.parse_args(argv)
    try:
        nproc = ranks_per_node(args.nproc)
    except ValueError as error:
        raise SystemExit(f"--nproc: {error}") from None
    pipe = PIPELINES[args.env]
    out = Path(args.out or f"runs/agentic-{args.env}{'-toy' if args.toy else ''}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    if unknown := [stage for stage in stages if stage not in STAGES]:
        raise SystemExit(f"--stages: unknown stage {unknown[0]!r} (choose from {', '.join(STAGES)})")
    evaluated = args.eval_models.split(",")
    if unknown := sorted(set(evaluated) - {"base", "sft", "sft+rl"}):
        raise SystemExit(f"--eval-models: unknown model {unknown[0]!r} (choose from base, sft, sft+rl)")
    if args.sft_from:
        sft_dir = Path(args.sft_from).resolve() / "sft"
        if not (sft_dir / "DONE").exists():
            raise SystemExit(f"--sft-from: {sft_dir} has no finished SFT stage (no DONE file)")
        stages = [s for s in stages if s not in ("collect", "sft")]
    else:
        sft_dir = out / "sft"
    toy = pipe.toy if args.toy else {}
    oracle = out / "oracle.jsonl"
    if "collect" in stages and not oracle.exists():
        tmp = out / "oracle.partial"
        collect = [f"env={pipe.env}", "policy=solver", "split=train", *pipe.collect, *toy.get("collect", [])]
        _run([sys.executable, "-m", "rl2gem.collect", *collect, f"output={tmp}", "progress=false"], out / "collect.log")
        tmp.rename(oracle)
    models = {"base": args.base}
    if "sft" in stages:
        extra = ["trainer.progress=false", f"data.train={oracle}", *toy.get("sft", [])]
        models["sft"] = str(_trained("sft", pipe.sft_config, sft_dir, args.base, extra, nproc, out / "sft.log"))
    elif (sft := _finished(sft_dir, None if args.sft_from else args.base)) is not None:
        models["sft"] = str(sft)
    if "ppo" in stages:
        if "sft" not in models:
            raise SystemExit(
                f"--stages ppo starts from the SFT model: {sft_dir} has no finished one (run the sft stage first)"
            )
        extra = ["trainer.progress=false", *toy.get("ppo", [])]
        models["sft+rl"] = str(
            _trained("ppo", pipe.ppo_config, out / "ppo", models["sft"], extra, nproc, out / "ppo.log")
        )
    elif (ppo := _finished(out / "ppo", models.get("sft"))) is not None:
        models["sft+rl"] = str(ppo)
    if "eval" in stages:
        for label, model in models.items():
            if label in evaluated:
                _evaluate(pipe, label, model, out, toy.get("eval", []))
    if "table" in stages:
        try:
            finished = {k: v for k, v in models.items() if (out / "eval" / f"{k}.jsonl").exists()}
            print(table(out, finished, segmented=any(arg.startswith("context.") for arg in pipe.eval)))
        except ValueError as e:  # no evaluation has finished
            raise SystemExit(f"table: {e} ({out / 'eval'})") from None
        print(f"table: {out / 'results.md'}  plot: {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    run_main(main)
