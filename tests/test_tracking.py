"""Metrics logging helpers: the end-of-run table."""

import json

from rl2gem.tracking import metrics_table


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
