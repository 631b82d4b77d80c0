"""Smoke tests: every example, the docs' env, the eval CLI and the benchmark run."""

import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, timeout=300):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# eval_with_openai_client.py needs a server: tests/test_openai_api.py runs it against one
@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "examples").glob("*.py") if "openai" not in p.name))
def test_example_runs(path):
    assert run(f"examples/{path}").strip(), f"examples/{path} printed nothing"


def test_custom_env_example_output():
    assert run("examples/custom_env.py").strip().endswith("-> ('Correct.', 1.0, True, False)")


def test_docs_show_the_example_verbatim():
    doc = (ROOT / "docs" / "contributing-envs.md").read_text()
    block = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    code = (ROOT / "examples" / "custom_env.py").read_text()
    assert block == code
    assert len(code.splitlines()) < 40


def test_evaluate_writes_episodes_and_summary(tmp_path):
    out = tmp_path / "episodes.jsonl"
    stdout = run("-m", "rl2gem.evaluate", "env=rl2/GuessTheNumber-Easy-v0", "n=30", f"output={out}", "progress=false")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 30 and all(r["success"] for r in records)  # the solver always wins
    assert len({r["seed"] for r in records}) == 30
    assert records[0]["messages"][0]["role"] == "user" and records[0]["messages"][1]["role"] == "assistant"
    assert re.search(r"accuracy \(success rate\)\s+1\.000", stdout)


def test_evaluate_plays_dataset_items_in_order(tmp_path):
    out = tmp_path / "aime.jsonl"
    run("-m", "rl2gem.evaluate", "env=rl2/AIME25-v0", "policy=solver", "n=100", f"output={out}", "progress=false")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(15))  # n is capped at the data set's size
    assert all(r["reward"] == 1.0 and r["format_ok"] for r in records)


def test_evaluate_is_reproducible(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        run(
            "-m",
            "rl2gem.evaluate",
            "env=rl2/Mastermind-v0",
            "policy=random",
            "n=10",
            "seed=3",
            f"output={p}",
            "progress=false",
        )
    assert a.read_text() == b.read_text()


def test_evaluate_rejects_unknown_keys_with_a_suggestion():
    r = subprocess.run([sys.executable, "-m", "rl2gem.evaluate", "modle=x"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "did you mean 'model'" in r.stderr


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["device=gpu0"], "config error: device: device 'gpu0'"),
        (["dtype=float8"], "config error: dtype: dtype must be"),
        (["env_errors=rasie"], "config error: env_errors: expected one of ['drop', 'raise'], got 'rasie'"),
        (
            ["env=rl2/GuessNumber-v0"],
            "config error: env: Environment `GuessNumber` doesn't exist in namespace rl2. "
            "Did you mean: `GuessTheNumber`?",
        ),
        (
            ["env_kwargs.max_turn=3"],
            "config error: env_kwargs: rl2/GuessTheNumber-v0 with {'max_turn': 3}: TypeError: "
            "GuessTheNumberEnv got unknown argument(s) ['max_turn']",
        ),
        (
            ["env_kwargs.max_turns=0"],
            "config error: env_kwargs: rl2/GuessTheNumber-v0 with {'max_turns': 0}: ValueError",
        ),
        (
            ["env=no_such_module:rl2/GuessTheNumber-v0"],
            "config error: env: no_such_module:rl2/GuessTheNumber-v0: the module",
        ),
    ],
)
def test_evaluate_and_collect_name_a_bad_argument_in_one_line_before_loading_anything(arguments, message, capsys):
    from rl2gem.collect import parse_args as collect_arguments
    from rl2gem.evaluate import parse_args

    for parse in (parse_args, collect_arguments):
        with pytest.raises(SystemExit) as stopped:
            parse(["model=/no/such/model", *arguments])
        error = capsys.readouterr().err
        assert stopped.value.code == 2 and error.startswith(message) and error.count("\n") == 1, error


def test_a_reward_model_given_as_the_policy_is_refused_before_anything_loads(tmp_path, capsys):
    """A reward model's folder given where a causal LM is expected (``evaluate model=``, ``rl2gem.serve
    --model``): transformers loaded it as a causal LM, and the server answered chat requests."""
    from rl2gem import serve
    from rl2gem.collect import parse_args as collect_arguments
    from rl2gem.evaluate import parse_args

    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    line = f"{folder} is a LlamaForSequenceClassification, not a causal language model"
    for parse in (parse_args, collect_arguments):
        with pytest.raises(SystemExit) as stopped:
            parse([f"model={folder}"])
        assert stopped.value.code == 2 and capsys.readouterr().err.strip() == f"config error: model: {line}"
    with pytest.raises(SystemExit) as stopped:
        serve.main(["--model", str(folder)])
    assert stopped.value.code == 2 and capsys.readouterr().err.strip().endswith(f"error: --model: {line}")


def test_the_docs_evaluate_command_takes_a_script_registered_env_as_module_and_id(tmp_path):
    """contributing-envs.md's command, run from examples/ as it says: ``env=module:id``, as
    ``gymnasium.make`` takes it (the module registers the env on import)."""
    doc = (ROOT / "docs" / "contributing-envs.md").read_text()
    (command,) = re.findall(r"```bash\n(python -m rl2gem.evaluate env=custom_env:[^\n]*)\n```", doc)
    out = tmp_path / "reverse.jsonl"
    arguments = [*shlex.split(command)[1:], f"output={out}", "progress=false"]
    r = subprocess.run([sys.executable, *arguments], cwd=ROOT / "examples", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 20 and all(1 <= record["turns"] <= 5 for record in records)
    assert "example/Reverse-v0" in r.stdout or "custom_env:example/Reverse-v0" in r.stdout


def test_evaluate_records_each_episodes_context_segments_and_summaries(tmp_path, tiny_dir):
    """GuessTheNumber-Easy in 140-token segments (an 83-token task, 4 turns of 8 + 23 tokens): every
    episode needs a summary to go on, and the record and the summary count them."""
    out = tmp_path / "summarized.jsonl"
    stdout = run(
        "-m",
        "rl2gem.evaluate",
        "env=rl2/GuessTheNumber-Easy-v0",
        f"model={tiny_dir}",
        "n=2",
        "max_new_tokens=8",
        "context.max_tokens=140",
        "context.policy=summarize",
        "context.summary_max_new_tokens=6",
        f"output={out}",
        "progress=false",
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(r["summaries"] == r["context_segments"] >= 1 for r in records)
    mean = sum(r["summaries"] for r in records) / 2
    assert re.search(rf"summaries / episode\s+{mean:.2f}", stdout), stdout


def test_evaluate_holds_an_episode_to_max_length_within_the_context(tmp_path, tiny_dir):
    """GuessTheNumber-Easy's task is 83 tokens: with ``max_length=86`` no episode gets past its
    first action, and the summary says so; a ``max_length`` past the tiny model's 2048-token
    context is held to it (the engine refused such prompts and the run stopped)."""
    common = ["-m", "rl2gem.evaluate", "env=rl2/GuessTheNumber-Easy-v0", f"model={tiny_dir}", "n=2"]
    common += ["max_new_tokens=4", "progress=false"]
    stdout = run(*common, "max_length=86", f"output={tmp_path}/short.jsonl")
    records = [json.loads(line) for line in (tmp_path / "short.jsonl").read_text().splitlines()]
    assert all(r["truncated"] and r["final_info"]["truncated_reason"] == "max_length" for r in records)
    assert re.search(r"truncated\s+1\.000 \(max_length 2\)", stdout), stdout
    long_prompt = "system_prompt=" + "word " * 2100  # past the context: the engine cannot take it
    stdout = run(*common, "max_length=100000", long_prompt, f"output={tmp_path}/long.jsonl")
    records = [json.loads(line) for line in (tmp_path / "long.jsonl").read_text().splitlines()]
    assert [(r["turns"], r["final_info"]["truncated_reason"]) for r in records] == [(0, "max_length")] * 2


def test_evaluate_renders_tools_with_the_chat_template(tmp_path, tiny_dir):
    """The tiny random Llama has SmolLM2's tokenizer and chat template: the rendering is the real one."""
    out = tmp_path / "pymath.jsonl"
    stdout = run(
        "-m",
        "rl2gem.evaluate",
        "env=rl2/PythonMath-v0",
        f"model={tiny_dir}",
        "n=2",
        "batch_size=2",
        "max_new_tokens=32",
        "tools_in_template=true",
        "chat_template=chatml_tools",
        f"output={out}",
        "progress=false",
        timeout=900,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and "generated tokens / s" in stdout
    assert all("<tools>" not in r["messages"][0]["content"] for r in records)  # the template offered them
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl2gem.evaluate",
            "env=rl2/PythonMath-v0",
            f"model={tiny_dir}",
            "n=1",
            "tools_in_template=true",
            "progress=false",
            f"output={tmp_path / 'refused.jsonl'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "does not render tools" in r.stderr  # SmolLM2's own template has no tools
    assert not (tmp_path / "refused.jsonl").exists()  # refused before any episode: no empty file left behind


# slow: make bench runs the script in full
@pytest.mark.slow
def test_retrieval_benchmark_smoke():
    stdout = run("benchmarks/retrieval.py", "--quick")
    assert re.search(r"^\| 8 \| \d+ \|", stdout, re.M)
    recall = re.search(r"^\| the subject \| ([\d.]+) \| ([\d.]+)", stdout, re.M)
    assert float(recall.group(2)) > 0.9  # BM25 finds the subject's article in the top 3
    assert "commonest train answer (`answer_prior`) gets 0.471 EM on the 227 test questions" in stdout


# slow: make bench runs the script in full; tests/test_envserver.py covers the serving path
@pytest.mark.slow
def test_env_server_benchmark_smoke():
    stdout = run("benchmarks/env_server.py", "--quick", "--sessions", "1,8")
    rows = re.findall(r"^\| (\d+) \| \d+ \| \d+ \| [\d.]+x \|$", stdout, re.M)
    assert rows == ["1", "8"]


# slow: make bench runs the script in full
@pytest.mark.slow
def test_env_throughput_benchmark_smoke():
    stdout = run("benchmarks/env_throughput.py", "--quick")
    rows = [line for line in stdout.splitlines() if line.startswith("| compute") or line.startswith("| io")]
    assert len(rows) == 4 and all(line.rstrip().endswith("x |") for line in rows)


# slow: make bench runs the script in full
@pytest.mark.slow
def test_sandbox_benchmark_smoke():
    stdout = run("benchmarks/sandbox.py", "--quick")
    rows = re.findall(r"^\| (1|8) \| [\d.]+ \|", stdout, re.M)
    assert rows == ["1", "8"]
    latency = re.findall(
        r"^\| (pool|session, next call|session, first call|fresh) \| [\d.]+ \| [\d.]+ \|$", stdout, re.M
    )
    assert latency == ["pool", "session, next call", "session, first call", "fresh"]


def test_engine_host_benchmark_smoke():
    """The engine's host-work benchmark at 32 rows: its table, the cache serving every row's
    prompt but the last token, and a wave's end dispatching fewer tensor operations than rows."""
    stdout = run("benchmarks/engine_host.py", "--rows", "32", "--group", "1", "--repeat", "1", "--device", "cpu")
    figures = dict(re.findall(r"^\| ([a-z ]+) \| ([\d.]+) \|", stdout, re.M))
    assert set(figures) == {"admit ms per row", "wave end ms per row", "wave end ops", "cached tokens per row"}
    assert float(figures["cached tokens per row"]) == 99.0 and float(figures["wave end ops"]) < 32


def test_detokenize_benchmark_smoke():
    """The detokenization benchmark's table at two short lengths (it checks the two texts agree)."""
    stdout = run("benchmarks/detokenize.py", "--lengths", "50,100")
    assert re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", stdout, re.M) == ["50", "100"]


def readme_blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.parametrize("index", range(len(readme_blocks("python"))))
def test_readme_python_blocks_run(index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_blocks("python")[index] + "\nprint('snippet ok')\n")
    assert run(str(script)).strip().endswith("snippet ok")


TRAINER_MODULES = ("rl2gem.trainers.ppo", "rl2gem.trainers.rm", "rl2gem.trainers.dpo")


def short_form(command: str, model: pathlib.Path) -> str:
    """A README command at smoke size: the trainers, the tuner, the agentic pipeline, the server and
    the evaluations on ``model`` (the tiny random Llama with SmolLM2's tokenizer) instead of SmolLM2;
    every key and flag as written. ``rl2gem.collect`` keeps the real model: the RM and DPO commands
    train on its preference pairs, which need a model that solves some items."""
    if "rl2gem.collect" in command:
        return command
    command = command.replace("smollm2-135m-instruct", str(model))
    if any(f"-m {module} " in command for module in TRAINER_MODULES) and "actor.model=" not in command:
        command += f" actor.model={model}"
    command = command.replace("'base=[", f"'base=[actor.model={model}, ")
    if "rl2gem.trainers.agentic" in command:
        command += f" --base {model}"
    return command


def test_short_forms_change_only_the_model(tmp_path):
    tiny = tmp_path / "tiny"
    ppo = ".venv/bin/python -m torch.distributed.run -m rl2gem.trainers.ppo config=arithmetic trainer.total_steps=2"
    assert short_form(ppo, tiny) == f"{ppo} actor.model={tiny}"
    evaluate = ".venv/bin/python -m rl2gem.evaluate env=rl2/SearchQA-v0 model=smollm2-135m-instruct n=2"
    assert short_form(evaluate, tiny) == f".venv/bin/python -m rl2gem.evaluate env=rl2/SearchQA-v0 model={tiny} n=2"
    collect = ".venv/bin/python -m rl2gem.collect model=smollm2-135m-instruct pairs=true"
    assert short_form(collect, tiny) == collect
    tune = ".venv/bin/python -m rl2gem.trainers.tune trainer=ppo 'base=[config=arithmetic]' n_trials=2"
    assert (
        short_form(tune, tiny)
        == f".venv/bin/python -m rl2gem.trainers.tune trainer=ppo 'base=[actor.model={tiny}, config=arithmetic]' n_trials=2"
    )


def readme_shell_blocks() -> list[list[str]]:
    """The README's bash blocks, each as its command lines (comments cut), leaving out the
    Quickstart's make targets (.ci/run runs those) and blocks with no other command. A block is
    what a reader runs together: a server in the background and the commands that use it."""
    blocks = [
        [line.split("#")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("make ")]
        for block in readme_blocks("bash")
    ]
    return [block for block in blocks if block]


def test_the_readme_has_its_command_blocks():
    blocks = readme_shell_blocks()
    commands = [command for block in blocks for command in block]
    assert len(blocks) >= 8 and all(command.startswith(".venv/bin/python ") for command in commands), commands
    for module in (
        "rl2gem.evaluate",
        "rl2gem.serve",
        "rl2gem.trainers.ppo",
        "rl2gem.trainers.agentic",
        "rl2gem.collect",
    ):
        assert any(f"-m {module} " in command for command in commands), module


@pytest.mark.timeout(900)
@pytest.mark.parametrize("form", ["short", pytest.param("full", marks=pytest.mark.slow)])
@pytest.mark.parametrize("block", range(len(readme_shell_blocks())))
def test_readme_shell_commands_run(block, form, tmp_path, tiny_dir):
    """Each README bash block's commands in order: the short form (:func:`short_form`) in the
    default suite, as written in ``make test-slow``. One test per block, so that the test workers
    of ``make test`` share them out."""
    commands = readme_shell_blocks()[block]
    if form == "short":
        commands = [short_form(command, tiny_dir) for command in commands]
    background = []  # servers a command line ending in & starts; stopped at the end
    try:
        for cmd in commands:
            run_readme_command(cmd, tmp_path, background)
    finally:
        for proc in background:
            proc.terminate()
            proc.wait(timeout=60)
    if any("output=remote.jsonl" in command for command in commands):  # episodes played through an env server
        records = [json.loads(line) for line in (tmp_path / "remote.jsonl").read_text().splitlines()]
        assert len(records) == 8 and len({r["seed"] for r in records}) == 8
        assert all(r["turns"] >= 1 and r["messages"][0]["content"] for r in records)
    if any("output=served.jsonl" in command for command in commands):
        served, local = (
            [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("served.jsonl", "local.jsonl")
        )
        # the model played: 2 episodes of at most 2 turns of at most 24 new tokens each
        assert len(local) == 2 and all(0 < r["generated_tokens"] <= 2 * 24 for r in local)
        assert all(m["content"] for r in local for m in r["messages"] if m["role"] == "assistant")
        same = [sorted(json.dumps(r["messages"]) for r in records) for records in (served, local)]
        assert same[0] == same[1]  # server= plays as the local model
        api = [json.loads(line) for line in (tmp_path / "api.jsonl").read_text().splitlines()]
        first_turns = [
            sorted(json.dumps([m for m in r["messages"] if m["role"] != "system"][:2]) for r in records)
            for records in (api, local)
        ]
        # the API renders the local run's first prompt, so the first reply is the same (greedy); with
        # the real model (the full form): the tiny one's reply hardly reads its prompt
        assert first_turns[0] == first_turns[1]


def run_readme_command(cmd: str, tmp_path: pathlib.Path, background: list) -> None:
    """Run one README command line in ``tmp_path`` (benchmarks and examples in the checkout), or
    start it in the background (a line ending in ``&``: a server, appended to ``background`` once
    healthy); assert what it wrote: a benchmark's table, a run's metrics and checkpoint, the agentic
    pipeline's results."""
    assert cmd.startswith(".venv/bin/python "), cmd
    args = shlex.split(cmd.removesuffix("&"))[1:]  # quoted arguments (a YAML mapping) stay whole
    if cmd.endswith("&"):
        port = re.search(r"--port (\d+)", cmd).group(1)
        background.append(subprocess.Popen([sys.executable, *args], cwd=tmp_path, stdin=subprocess.PIPE))
        wait_until_healthy(f"http://127.0.0.1:{port}/health", background[-1], cmd)
        return
    uses_root = args[0].startswith(("benchmarks/", "examples/"))  # they write nothing in the checkout
    cwd = ROOT if uses_root else tmp_path
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, cmd + "\n" + r.stderr
    if args[0].startswith("benchmarks/"):
        assert "|---|" in r.stdout, cmd  # it printed its table
    for output_dir in re.findall(r"trainer\.output_dir=(\S+)", cmd):
        run_dir = tmp_path / output_dir
        assert (run_dir / "metrics.jsonl").read_text().strip(), cmd
        assert list(run_dir.glob("checkpoint-*/hf/config.json")), cmd
        shutil.rmtree(run_dir)  # each checkpoint is about 2 GB; no later command reads it
    for pipeline_dir in re.findall(r"rl2gem\.trainers\.agentic .*--out (\S+)", cmd):
        run_dir = tmp_path / pipeline_dir
        results = (run_dir / "results.md").read_text().splitlines()
        rows = [row.split(" | ")[0] for row in results[2:] if row.startswith("|")]
        assert rows == ["| base", "| sft", "| sft+rl"], cmd  # every stage ran, every model evaluated
        paired = [row.split(":")[0] for row in results if row.startswith("Paired")]
        assert paired == ["Paired, base -> sft", "Paired, sft -> sft+rl"], cmd  # each model against the one before
        assert (run_dir / "sft" / "DONE").exists() and (run_dir / "ppo" / "DONE").exists(), cmd
        assert (run_dir / "results.png").stat().st_size > 1000, cmd
        if "multihop-summarize" in cmd:  # the PPO stage's rollouts summarised to stay in their context
            ppo = [json.loads(line) for line in (run_dir / "ppo" / "metrics.jsonl").read_text().splitlines()]
            assert any(row.get("rollout/summaries", 0) > 0 for row in ppo), cmd
        shutil.rmtree(run_dir)


def wait_until_healthy(url: str, proc: subprocess.Popen, cmd: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{cmd} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{cmd}: {url} did not answer in {timeout:.0f} s")


# slow: make bench runs the script in full
@pytest.mark.slow
def test_rollout_benchmark_smoke(tiny_dir):
    """The script end to end on a tiny random model (the real model's numbers are in RESULTS.md)."""
    stdout = run("benchmarks/rollout.py", "--quick", "--model", str(tiny_dir))
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and line.rstrip().endswith("x |")]
    assert len(rows) == 3 + 5 + 2 + 2 + 2, stdout  # decode, engine, router, tokens, partial
    assert stdout.count("EmbeddedEngine, lean forward") == 3 and stdout.count("model(...) forward") >= 2, stdout
    assert "prefix merging" in stdout and "partial rollouts" in stdout


# slow: make bench runs the script in full
@pytest.mark.slow
def test_tree_packing_benchmark_smoke(tiny_dir):
    """Flat against prefix-tree packing on real rollouts of a tiny random model: the tree computes
    fewer tokens, and all four rows (whole-row SDPA, block attention, the last with the LM head at
    action tokens only) give the same log-probs at the action tokens (the real model's numbers are in RESULTS.md)."""
    import re

    stdout = run("benchmarks/tree_packing.py", "--quick", "--model", str(tiny_dir))
    for env in ("GSM8K", "SearchQA"):
        section = stdout.split(f"# {env}")[1].split("\n\n")[0:2]
        difference = float(re.search(r"largest log-prob difference at action tokens (\S+)", section[0]).group(1))
        assert difference < 1e-4, stdout
        rows = [line for line in section[1].splitlines() if line.startswith(("| flat", "| prefix tree"))]
        whole, flat, tree, action_head = (int(row.split("|")[2]) for row in rows)
        assert whole == flat and tree < flat and action_head == tree, stdout


def test_logprob_mismatch_benchmark_smoke(tiny_dir):
    """The four rows of the table; the fp32 control (eager against SDPA) agrees to float rounding
    while bf16 moves the log-probs (SmolLM2's numbers are in RESULTS.md)."""
    stdout = run("benchmarks/logprob_mismatch.py", "--quick", "--model", str(tiny_dir))
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): [float(x) for x in line.split("|")[3:6]]
        for line in stdout.splitlines()
        if line.startswith(("| bf16", "| fp32"))
    }
    assert list(rows) == [
        ("bf16 eager", "fp32 sdpa"),
        ("bf16 sdpa", "fp32 sdpa"),
        ("bf16 eager", "bf16 sdpa"),
        ("fp32 eager", "fp32 sdpa"),
    ], stdout
    assert rows["fp32 eager", "fp32 sdpa"][2] < 1e-4, stdout
    assert all(rows[pair][1] > 1e-4 for pair in list(rows)[:2]), stdout


# slow: make bench runs the script in full
@pytest.mark.slow
def test_trainer_benchmark_smoke(tiny_dir):
    """Both trainers end to end on a tiny random model (the real model's numbers are in RESULTS.md)."""
    stdout = run("benchmarks/trainer.py", "--quick", "--model", str(tiny_dir), "--lora", "4", "--packings", "tree")
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and line.rstrip().endswith("x |")]
    assert len(rows) == 4 and "rl2gem PPO trainer" in rows[0] and "TRL GRPOTrainer" in rows[1], stdout
    assert "tree packing" in rows[0] and "LoRA r=4" in rows[2] and "LoRA r=4" in rows[3], stdout
    for row in rows:  # response tokens and peak memory are measured on both sides
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3]) > 0 and float(cells[6]) > 50, row
    phases = [line for line in stdout.split("Our step by phase")[1].splitlines() if line.startswith("| rl2gem")]
    assert len(phases) == 2, stdout  # ours with and without LoRA: each phase's seconds, none negative
    for row in phases:
        cells = [float(c) for c in row.strip().strip("|").split("|")[1:]]
        assert min(cells[:4]) >= 0 and cells[0] + cells[2] > 0, row


def test_proof_tables_read_runs(tmp_path):
    """benchmarks/proof_table.py on hand-written metrics of two runs per kind."""
    for name, kl, coef in (("fixed", 0.04, 0.05), ("pid", 0.02, 0.1)):
        run_dir = tmp_path / "kl" / name
        run_dir.mkdir(parents=True)
        rows = [
            {"step": s, "actor/kl": kl, "kl/coef": coef * s, "rollout/reward": 0.5, "actor/entropy": 0.5,
             "constraint/entropy_multiplier": 0.1, "rollout/stale_token_fraction": 0.5, "critic/vf_loss": 0.1,
             "actor/mismatch_kl": 0.001, **({"kl/target": 0.02} if name != "fixed" else {})}
            for s in (1, 2, 3, 4)
        ] + [{"step": 4, "eval/success": 0.25}]  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stdout = run("benchmarks/proof_table.py", "kl", str(tmp_path / "kl"))
    assert "| fixed | - | 0.0400 | - | 0.05 -> 0.2 | 0.25 |" in stdout
    assert "| pid | 0.02 | 0.0200 | 1.00 | 0.1 -> 0.4 | 0.25 |" in stdout
    assert "| 4 | 0.500 | 0.500 | 0.100 |" in run("benchmarks/proof_table.py", "entropy", str(tmp_path / "kl"))
    assert "| pid | 0.50 | 0.500 | 0.1000 | 0.0010 | 0.25 |" in run(
        "benchmarks/proof_table.py", "offpolicy", str(tmp_path / "kl")
    )
    assert (tmp_path / "kl" / "curves.png").stat().st_size > 1000


def test_the_gpu_session_imports_only_what_the_device_image_has():
    """benchmarks/gpu_image.py: in an environment holding only the device image's distributions
    and the session's wheels, the trainers, evaluation and envs import, pytest collects the GPU
    tests, benchmarks/gpu.py starts and benchmarks/fsdp_one_rank.py runs; the control leaves
    omegaconf out and the check fails, naming it."""
    stdout = run("benchmarks/gpu_image.py", timeout=300)
    assert stdout.splitlines()[:4] == [
        "imports: ok", "pytest collects tests/test_gpu.py: ok", "benchmarks/gpu.py --help: ok",
        "benchmarks/fsdp_one_rank.py, tiny: ok",
    ], stdout  # fmt: skip
    control = subprocess.run(
        [sys.executable, "benchmarks/gpu_image.py", "--without", "omegaconf"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert control.returncode == 1 and "imports: FAILED" in control.stdout, control.stdout
    assert "No module named 'omegaconf'" in control.stdout, control.stdout


# slow: make bench runs the script in full
@pytest.mark.slow
def test_gpu_benchmark_smoke(tiny_dir):
    """benchmarks/gpu.py end to end on the CPU fallback (a tiny model, short rows): the SFT, DPO and
    RM trainers' data paths and their plain padded loops train the same rows to the same loss,
    and the decode tables are printed, a queue of requests too (the GPU's numbers are in
    RESULTS.md)."""
    stdout = run(
        "benchmarks/gpu.py",
        "--models", "64x2", "--sections", "sft,dpo,rm,decode,mask", "--steps", "3", "--scale", "0.05",
        "--rows", "4", "--new-tokens", "4", "--tokenizer", str(tiny_dir),
        timeout=900,
    )  # fmt: skip
    assert "MFU peak:" in stdout and "Llama 64 x 2" in stdout, stdout
    lines = stdout.splitlines()
    for trainer in ("sft", "dpo", "rm"):
        start = lines.index(f"| {trainer} rows | side | tokens/s | MFU | vs plain loop | last loss |")
        table = [line.split("|") for line in lines[start + 2 : start + 6]]
        for kind, plain, ours in ((table[0][1], table[0], table[1]), (table[2][1], table[2], table[3])):
            assert kind.strip() in ("mixed", "long") and ours[1] == kind, stdout
            assert "plain padded loop" in plain[2] and f"rl2gem {trainer}" in ours[2], stdout
            plain_loss, our_loss = float(plain[6]), float(ours[6])  # the last step's loss, before its update
            assert abs(plain_loss - our_loss) <= 1e-3 * abs(plain_loss), stdout
    decode = [line for line in lines if line.startswith("| 4 |") and not line.startswith("| 4 | 12 |")]
    assert len(decode) == 3 and all(float(line.split("|")[3]) > 0 for line in decode[1:]), stdout
    assert "decode_steps=4" in decode[2], stdout
    queue = [line.split("|") for line in lines if line.startswith("| 4 | 12 |")]  # 3 x 4 requests for 4 rows
    assert [row[3].strip() for row in queue] == ["rl2gem EmbeddedEngine", "rl2gem EmbeddedEngine decode_overlap=True"]
    assert all(float(row[4]) > 0 for row in queue), stdout
    masks = [line.split("|") for line in lines if line.startswith(("| 4096 |", "| 16384 |"))]
    assert [row[2].strip() for row in masks] == ["create_block_mask", "flex_block_mask (ours)"] * 2, stdout
