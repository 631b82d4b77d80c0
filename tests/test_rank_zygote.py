"""The tests' torchrun jobs fork their ranks from tests/rank_zygote.py (helpers.RankZygote): the
ranks must see what torchrun gives them, and a failing rank must fail the job as under torchrun."""

import json
import subprocess
import time

import pytest
from helpers import ROOT, RankZygote, torchrun_command

RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "OMP_NUM_THREADS", "EXTRA")
row = {"argv": sys.argv[1:], "cwd": os.getcwd(), "sum": total.item(),
       "env": {name: os.environ.get(name) for name in names}}
# one write(2) per line: under PYTHONUNBUFFERED, print() writes the text and its newline apart, and
# torchrun's ranks share one stdout pipe, so two ranks' lines could interleave
os.write(1, (json.dumps(row) + "\\n").encode())
dist.destroy_process_group()
"""


def test_ranks_see_what_torchrun_gives_them(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    cmd, env = torchrun_command(2, str(script), "a", "b=1")
    env["EXTRA"] = "x"
    launched = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=True)
    code, stdout, _ = RankZygote.shared().run(2, str(script), ["a", "b=1"], ROOT, env, timeout=300)
    assert code == 0
    forked, real = (
        sorted((json.loads(line) for line in out.splitlines()), key=lambda row: row["env"]["RANK"])
        for out in (stdout, launched.stdout)
    )
    assert forked == real
    assert [row["env"]["RANK"] for row in forked] == ["0", "1"] and forked[0]["sum"] == 3.0


FAILING_SCRIPT = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 fails", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""


def test_a_failing_rank_fails_the_job_and_stops_the_others(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    _, env = torchrun_command(2)
    start = time.monotonic()
    code, _, stderr = RankZygote.shared().run(2, str(script), [], ROOT, env, timeout=300)
    assert code == 3 and "rank 1 fails" in stderr
    assert time.monotonic() - start < 60  # rank 0 was killed, not waited for


def test_a_job_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(120)\n")
    _, env = torchrun_command(1)
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        RankZygote.shared().run(1, str(script), [], ROOT, env, timeout=2)
    assert time.monotonic() - start < 30
