"""Metrics logging helpers: the end-of-run table and plot."""

import json

from rl2gem.tracking import Tracker, metrics_table, plot_metrics


def test_metrics_table_keeps_eval_steps_and_the_last_value_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/success": 0.25}]
    rows += [{"step": s, "rollout/reward": s / 100} for s in range(1, 31)]
    rows += [{"step": 10, "eval/success": 0.5}, {"step": 30, "eval/success": 0.75}]
    rows += [{"step": 5, "rollout/reward": 0.99}]  # re-logged by a resumed run: the last one wins
    path.write_text("\n".join(json.dumps(r) for r in rows))
    lines = metrics_table(path, keys=("rollout/reward", "eval/success"), max_rows=6).splitlines()
    assert lines[0] == "| step | rollout/reward | eval/success |"
    body = {int(line.split("|")[1]): line for line in lines[2:]}
    assert len(body) == 6 and {0, 10, 30} <= set(body)
    assert body[0] == "| 0 |  | 0.250 |" and body[30] == "| 30 | 0.300 | 0.750 |"
    full = metrics_table(path, keys=("rollout/reward",), max_rows=100)
    assert "| 5 | 0.990 |" in full and full.count("\n| ") == 30


def test_plot_draws_a_resumed_runs_repeated_steps_once(tmp_path, drawn_lines):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "rollout/reward": s / 10} for s in (1, 2, 3, 4)]
    rows += [{"step": 3, "rollout/reward": 0.9}, {"step": 4, "rollout/reward": 0.8, "eval/success": 0.5}]  # resumed
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = plot_metrics(path, tmp_path / "curves.png")
    assert drawn_lines == {"rollout/reward": ([1, 2, 3, 4], [0.1, 0.2, 0.9, 0.8]), "eval/success": ([4], [0.5])}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlflow_and_tensorboard_record_what_was_logged_and_a_resumed_run_continues(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {"actor": {"lr": 1e-5, "model": "m"}, "loggers": ["jsonl", "mlflow"], "seed": 3}
    tracker = Tracker(["jsonl", "mlflow", "tensorboard"], tmp_path, config=config, project="proj")
    tracker.log({"eval/success": 0.25, "actor/kl": 0.5, "bad": float("nan"), "note": "text"}, step=1)
    tracker.log({"eval/success": 0.5, "weird key@1": 2.0}, step=2)
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params == {"actor.lr": "1e-05", "actor.model": "m", "loggers": '["jsonl", "mlflow"]', "seed": "3"}
    assert run.data.metrics == {"eval/success": 0.5, "actor/kl": 0.5, "weird key_1": 2.0}  # no NaN, no text
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/success")] == [(1, 0.25), (2, 0.5)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/success")] == [(1, 0.25), (2, 0.5)]

    resumed = Tracker(["mlflow"], tmp_path, config={"actor": {"lr": 2e-5}}, project="proj")
    resumed.log({"eval/success": 0.75}, step=3)
    resumed.close()
    assert (tmp_path / "mlflow_run_id").read_text().strip() == run_id
    assert [m.step for m in client.get_metric_history(run_id, "eval/success")] == [1, 2, 3]
    assert client.get_run(run_id).data.params["actor.lr"] == "1e-05"  # parameters are the first run's


def test_a_new_run_starts_its_own_logs_and_a_resumed_one_continues_them(tmp_path, monkeypatch):
    """Without ``resume`` a run in a used folder appended to the old ``metrics.jsonl`` (the report
    blended two runs) and continued the old MLflow run; a resumed run opened a new wandb run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = Tracker(["jsonl", "mlflow", "wandb"], tmp_path, config={"seed": 1}, resume=False)
    first.log({"loss": 1.0}, step=1)
    wandb_id = first._wandb.id
    first.close()
    mlflow_id = (tmp_path / "mlflow_run_id").read_text().strip()
    assert (tmp_path / "wandb_run_id").read_text().strip() == wandb_id

    resumed = Tracker(["jsonl", "mlflow", "wandb"], tmp_path, config={"seed": 1}, resume=True)
    resumed.log({"loss": 0.5}, step=2)
    assert resumed._wandb.id == wandb_id
    resumed.close()
    assert (tmp_path / "mlflow_run_id").read_text().strip() == mlflow_id
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    new = Tracker(["jsonl", "mlflow", "wandb"], tmp_path, config={"seed": 2}, resume=False)
    new.log({"loss": 9.0}, step=1)
    assert new._wandb.id != wandb_id
    new.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 9.0}
    ]
    new_mlflow = (tmp_path / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert new_mlflow != mlflow_id and client.get_run(new_mlflow).data.params == {"seed": "2"}
