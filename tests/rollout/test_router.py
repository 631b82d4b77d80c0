"""Two embedded servers behind the real sglang-router: spread, control fan-out, failover."""

import asyncio
import json
import urllib.request

import pytest

from rl2gem.rollout import HTTPEngine, Rollout, RolloutConfig
from rl2gem.rollout.router import Router
from rl2gem.serving import launch


@pytest.fixture
def servers(tiny_model_dir):
    procs = [launch(str(tiny_model_dir), threads=1, seed=i) for i in range(2)]
    yield procs
    for p in procs:
        p.stop()


def served(url):
    with urllib.request.urlopen(url + "/get_server_info", timeout=5) as r:
        return json.loads(r.read())["internal_states"][0].get("requests", 0)


def test_round_robin_spreads_and_control_calls_reach_every_worker(servers):
    urls = [s.url for s in servers]
    with Router(urls, policy="round_robin") as router:

        async def main():
            eng = HTTPEngine(router.url, workers=router.workers)
            outs = await asyncio.gather(*(eng.generate([1, 2, 3 + i], {"max_new_tokens": 4}) for i in range(20)))
            long = asyncio.ensure_future(
                asyncio.gather(*(eng.generate([1, 9], {"max_new_tokens": 1900, "ignore_eos": True}) for _ in range(4)))
            )
            await asyncio.sleep(1.0)
            await eng.pause()
            cut = await long
            await eng.update_weights({}, version=3)  # empty update: only the version moves
            await eng.resume()
            after = await eng.generate([1, 2, 3], {"max_new_tokens": 2})
            loads = await eng.get_load()
            await eng.close()
            return outs, cut, after, loads

        outs, cut, after, loads = asyncio.run(main())
    assert all(len(o.output_ids) <= 4 for o in outs)
    counts = [served(u) for u in urls]
    assert min(counts) >= 10  # 20 generate calls split evenly (plus the later ones)
    assert all(o.aborted for o in cut)  # pause reached both workers
    assert after.weight_version == 3
    assert len(loads) == 2 and all(isinstance(x, list) and x[0]["dp_rank"] == 0 for x in loads)


def test_a_dead_worker_is_dropped_and_the_rollout_completes(servers, tokenizer):
    urls = [s.url for s in servers]
    with Router(urls, policy="round_robin") as router:

        async def main():
            eng = HTTPEngine(router.url, workers=router.workers)
            ro = Rollout(
                eng, tokenizer, "rl2/GuessTheNumber-Easy-v0", RolloutConfig(responses_per_prompt=2, max_new_tokens=64)
            )
            task = asyncio.ensure_future(ro.collect(8))
            while ro.stats["requests"] < 20:  # mid-rollout
                await asyncio.sleep(0.05)
            assert not task.done()
            servers[0].kill()  # SIGKILL mid-rollout
            batch = await task
            after = await ro.collect(1)
            await ro.close()
            await eng.close()
            return batch, after

        batch, after = asyncio.run(main())
        healthy = router.readiness()["healthy_workers"]
    assert not servers[0].alive
    assert len(batch.groups) == 8 and all(e.turns == 4 for e in batch.episodes)
    assert all(r.endswith(("length", "stop")) for e in batch.episodes for r in e.finish_reasons)
    assert len(after.groups) == 1 and healthy == 1


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        Router(["http://127.0.0.1:1"], policy="fastest")
    with pytest.raises(ValueError, match="worker"):
        Router([])
