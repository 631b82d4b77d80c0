"""SearchQA-v0 against real retrieval processes on loopback."""

import asyncio
import copy
import pickle
import socket
import subprocess
import sys
import time

import aiohttp
import gymnasium as gym
import numpy as np
import pytest
from aiohttp import web
from rl2gem.envs.search_qa import SearchQAEnv, answer_prior, bridge_recall, load_questions

import rl2gem
from rl2gem.retrieval import BM25Index, RetrievalClient, RetrievalError, load_corpus, make_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl2gem.retrieval", "serve", "--port", str(port), "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("RL2GEM_RETRIEVAL_READY"), line
    return proc


def stop_service(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)
    proc.stdout.close()


@pytest.fixture(scope="module")
def service():
    BM25Index.load_or_build()
    port = free_port()
    proc = start_service(port)
    yield f"http://127.0.0.1:{port}"
    stop_service(proc)


def test_questions_prepared_from_bigbench_and_the_corpus():
    train, test = load_questions("train"), load_questions("test")
    assert (len(train), len(test)) == (2434, 516)
    assert not {q["subject"] for q in train} & {q["subject"] for q in test}  # split by subject
    q = next(q for q in test if q["question"] == "What is the country of Addis Ababa?")
    assert q["answers"] == ["Ethiopia"]


def test_protocol_search_answer_and_errors(service):
    env = rl2gem.make("rl2/SearchQA-v0", split="test", retrieval_url=service, max_searches=2)
    obs, info = env.reset(options={"index": 0})
    item = env.unwrapped.item
    assert item["question"] in obs and "<search>" in obs
    obs, r, term, trunc, info = env.step(f"I should look it up. <search>{item['subject']}</search>")
    assert info["role"] == "tool" and obs.startswith("<information>Doc 1 (Title: ") and r == 0.0
    assert item["subject"] in obs and info["num_searches"] == 1
    obs, r, term, trunc, info = env.step("no tags at all")
    assert info["invalid_action"] == "missing <search> or <answer> tag" and not term
    obs, r, term, trunc, info = env.step("<search>   </search>")
    assert info["invalid_action"] == "empty search query"
    obs, r, term, trunc, info = env.step(f"<answer>The {item['answers'][0]}.</answer>")
    assert term and r == 1.0 and info["em"] == 1.0 and info["f1"] == 1.0 and info["num_searches"] == 1
    env.close()


def test_a_search_written_before_an_answer_is_a_search(service):
    """Search-R1 stops generation at ``</search>``: here the first complete tag decides. A model
    that writes its own ``<information>`` and answers from it after a search gets the search's
    real passages, not a reward (it was scored on the answer, without ever reading the index);
    an answer written first still answers, the last one counting."""
    env = SearchQAEnv("test", retrieval_url=service)
    env.reset(options={"index": 0})
    gold, subject = env.item["answers"][0], env.item["subject"]
    action = f"<search>{subject}</search><information>made up</information><answer>{gold}</answer>"
    obs, r, term, _, info = env.step(action)
    assert not term and r == 0.0 and info["query"] == subject and subject in obs and "made up" not in obs
    _, r, term, _, info = env.step(f"<answer>no</answer> or rather <answer>{gold}</answer> <search>x</search>")
    assert term and r == 1.0 and info["num_searches"] == 1
    env.close()


def test_search_limit_and_turn_limit_truncate(service):
    env = SearchQAEnv("test", retrieval_url=service, max_searches=1, max_turns=6)
    env.reset(seed=0)
    env.step("<search>a</search>")
    obs, r, term, trunc, info = env.step("<search>b</search>")
    assert trunc and not term and info["truncated_reason"] == "max_searches" and "limit" in obs
    env.close()
    env = SearchQAEnv("test", retrieval_url=service, max_turns=2)
    env.reset(seed=0)
    env.step("hmm")
    assert env.step("hmm")[3] is True
    env.close()


def test_an_episode_that_ends_on_an_empty_action_reports_its_searches_and_no_match(service):
    """An action rejected before the step (empty, too long, not UTF-8) lost the episode's searches
    and em from the last info, which evaluation reads: 2 searches counted as 0, em left out."""
    env = SearchQAEnv("test", retrieval_url=service, max_turns=3)
    env.reset(seed=0)
    env.step("<search>a</search>")
    env.step("<search>b</search>")
    _, reward, _, truncated, info = env.step("   ")
    assert truncated and info["truncated_reason"] == "max_turns" and info["invalid_action"] == "the action is empty"
    assert (info["num_searches"], info["em"], info["f1"], reward) == (2, 0.0, 0.0, 0.0)
    assert info["reward_components"] == {"correctness": 0.0, "f1": 0.0, "searches": 2.0}
    env.close()


def test_wrong_answer_gets_f1_but_no_em(service):
    env = SearchQAEnv("test", retrieval_url=service)
    env.reset(options={"index": 0})
    gold = env.item["answers"][0]
    _, r, term, _, info = env.step(f"<answer>{gold} and somewhere else</answer>")
    assert term and r == 0.0 and 0.0 < info["f1"] < 1.0


def test_service_down_is_reported_and_the_episode_goes_on():
    env = SearchQAEnv("test", retrieval_url=f"http://127.0.0.1:{free_port()}", retries=1, timeout=2)
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step("<search>anything</search>")
    assert "Search failed" in obs and "search_error" in info and not term and not trunc and info["role"] == "tool"
    obs, r, term, *_ = env.step("<answer>x</answer>")
    assert term
    env.close()


def test_slow_service_times_out():
    async def main():
        release = asyncio.Event()

        async def slow(request):  # answers only when the test says so
            await asyncio.wait_for(release.wait(), 60)
            return web.json_response({"result": [[]]})

        app = web.Application()
        app.add_routes([web.post("/retrieve", slow)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        env = SearchQAEnv("test", retrieval_url=f"http://127.0.0.1:{port}", timeout=0.3, retries=1)
        await env.areset(seed=0)
        t0 = time.perf_counter()
        obs, r, term, trunc, info = await env.astep("<search>slow</search>")
        elapsed = time.perf_counter() - t0
        release.set()
        await env.aclose()
        await runner.cleanup()
        return obs, info, elapsed

    obs, info, elapsed = asyncio.run(main())
    assert "timed out" in info["search_error"] and "Search failed" in obs
    assert elapsed < 30  # gave up on its own timeouts (2 x 0.3 s); the server had not answered at all


def test_service_restart_is_picked_up():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_service(port)

    async def main():
        env = SearchQAEnv("test", retrieval_url=url, retries=0, timeout=2)
        await env.areset(seed=0)
        first = await env.astep("<search>Paris</search>")
        stop_service(proc)
        down = await env.astep("<search>Paris</search>")
        again = start_service(port)
        up = await env.astep("<search>Paris</search>")
        await env.aclose()
        stop_service(again)
        return first, down, up

    first, down, up = asyncio.run(main())
    assert "Doc 1" in first[0] and "Search failed" in down[0] and "Doc 1" in up[0]


def test_concurrent_oracle_episodes_against_one_service(service):
    """The oracle (search the subject, answer the gold) gets EM 1.0 on every test question."""
    n = len(load_questions("test"))
    venv = rl2gem.make_vec("rl2/SearchQA-v0", 16, split="test", retrieval_url=service)

    async def main():
        ems = []
        for start in range(0, n, 16):
            idx = list(range(start, min(n, start + 16)))
            await venv.areset(options=[{"index": i} for i in idx], indices=list(range(len(idx))))
            solvers = {k: venv.envs[k].unwrapped.make_solver() for k in range(len(idx))}
            obs, *_ = await venv.astep({k: solvers[k]("") for k in solvers})
            assert all(o.startswith("<information>") for o in obs)
            _, rewards, term, _, infos = await venv.astep({k: solvers[k]("") for k in solvers})
            assert term.all()
            ems.extend(i["em"] for i in infos)
        await venv.aclose()
        return ems

    ems = asyncio.run(main())
    assert len(ems) == n and np.mean(ems) == 1.0


def test_answering_from_the_question_alone_scores_low(service):
    env = SearchQAEnv("test", retrieval_url=service)
    ems = []
    for i in range(len(env)):
        env.reset(options={"index": i})
        ems.append(env.step(f"<answer>{env.item['subject']}</answer>")[1])
    assert np.mean(ems) < 0.05


def test_embedded_service_starts_and_stops_with_the_envs():
    from rl2gem.retrieval import EmbeddedService

    a, b = SearchQAEnv("test"), SearchQAEnv("test")
    a.reset(seed=0)
    b.reset(seed=1)
    assert "Doc 1" in a.step("<search>Berlin</search>")[0]
    assert "Doc 1" in b.step("<search>Rome</search>")[0]
    proc = EmbeddedService._proc
    assert proc is not None and proc.poll() is None and EmbeddedService._users == 2
    a.close()
    assert proc.poll() is None  # still used by b
    b.close()
    assert proc.wait(timeout=10) == 0 and EmbeddedService._proc is None


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_searches_through_its_own_loop_and_client_and_its_close_leaves_the_original_searching(how):
    from rl2gem.retrieval import EmbeddedService

    duplicate = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda e: pickle.loads(pickle.dumps(e))}[how]
    users = EmbeddedService._users
    env = twin = SearchQAEnv("test")
    try:
        env.reset(seed=0)
        first = env.step("<search>Berlin</search>")[0]
        loop, client, proc = env._private_loop, env._retrieval._client, EmbeddedService._proc
        assert "Doc 1" in first and EmbeddedService._users == users + 1
        twin = duplicate(env)
        assert twin.item == env.item and twin.num_searches == 1  # the episode came along
        assert getattr(twin, "_private_loop", None) is None and twin._retrieval is not env._retrieval
        assert twin.step("<search>Berlin</search>")[0] == first
        assert twin._private_loop.loop is not loop.loop and EmbeddedService._users == users + 2
        twin.close()
        assert loop.loop.is_running() and proc.poll() is None and EmbeddedService._users == users + 1
        assert env.step("<search>Berlin</search>")[0] == first and env._retrieval._client is client
    finally:
        twin.close()
        env.close()
    assert EmbeddedService._users == users
    if not users:
        assert proc.wait(timeout=10) == 0 and EmbeddedService._proc is None


def test_service_validates_requests(service):
    async def main():
        async with aiohttp.ClientSession() as s:
            out = []
            bodies = ({"queries": "not a list"}, {"queries": ["x"], "topk": 0}, {"queries": []})
            for body in (*bodies, {"queries": ["x"], "return_scores": "false"}):
                async with s.post(f"{service}/retrieve", json=body) as r:
                    out.append((r.status, (await r.json())["error"]))
            async with s.post(f"{service}/retrieve", data=b"{broken") as r:
                out.append((r.status, (await r.json())["error"]))
            async with s.get(f"{service}/health") as r:
                health = await r.json()
            async with s.post(f"{service}/retrieve", json={"queries": ["Eiffel Tower", "Nile"], "topk": 2}) as r:
                plain = await r.json()
            # one query in NFC, one with a combining mark (u + U+0308): the same documents
            body = {"queries": ["Z\u00fcrich", "Zu\u0308rich"], "topk": 3}
            async with s.post(f"{service}/retrieve", json=body) as r:
                forms = (await r.json())["result"]
        return out, health, plain, forms

    errors, health, plain, forms = asyncio.run(main())
    assert forms[0] == forms[1] and any("Z\u00fcrich" in hit["contents"] for hit in forms[0])
    assert all(status == 400 and msg for status, msg in errors) and len(errors) == 5
    assert errors[3][1] == "'return_scores' must be true or false"
    assert health == {"status": "ok", "documents": 10033}
    assert len(plain["result"]) == 2 and all(len(row) == 2 and "contents" in row[0] for row in plain["result"])


def test_client_raises_after_retries():
    client = RetrievalClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.01, timeout=1)

    async def main():
        try:
            await client.retrieve(["x"])
        finally:
            await client.aclose()

    with pytest.raises(RetrievalError, match="failed"):
        asyncio.run(main())


def test_concurrent_requests_are_batched_without_changing_answers():
    """32 concurrent requests (mixed topk, some with 2 queries) answer exactly what one search each gives."""
    index = BM25Index.load_or_build()
    questions = [q["question"] for q in load_questions("test")[:48]]
    requests = [(questions[i : i + 1 + i % 2], 1 + i % 5) for i in range(32)]

    async def main():
        runner = web.AppRunner(make_app(index))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = RetrievalClient(f"http://127.0.0.1:{port}")
        out = await asyncio.gather(*(client.retrieve(qs, k) for qs, k in requests))
        await client.aclose()
        await runner.cleanup()
        return out

    answers = asyncio.run(main())
    for (qs, k), got in zip(requests, answers, strict=True):
        expected = index.search(qs, k)
        assert [[int(h["document"]["id"]) for h in row] for row in got] == [[i for i, _ in row] for row in expected]
        assert all(len(row) <= k for row in got)
    top = index.search(["Eiffel Tower Paris"], 3)[0]
    assert index.corpus[top[0][0]]["title"] == "Eiffel Tower"


def test_users_own_questions_file(tmp_path, service):
    import json

    path = tmp_path / "qa.jsonl"
    rows = [
        {"question": "Where is the Eiffel Tower?", "answers": ["Paris", "France"]},
        {"question": "Which river flows through Cairo?", "answers": "Nile"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = rl2gem.make("rl2/SearchQA-v0", data=str(path), split="test", retrieval_url=service)
    assert len(env.unwrapped) == 2
    env.reset(options={"index": 1})
    obs, *_ = env.step("<search>Nile</search>")
    assert "Nile" in obs
    _, r, term, _, info = env.step("<answer>the Nile</answer>")
    assert term and r == 1.0 and info["golds"] == ["Nile"]
    env.close()


def test_two_hop_questions_need_two_articles():
    """Each two-hop question composes two facts of the corpus: the subject's article names the
    bridge, the bridge's article names a gold answer, and no gold answer is in the subject's."""
    train, test = load_questions("train", hops=2), load_questions("test", hops=2)
    assert (len(train), len(test)) == (416, 227)
    assert not {q["bridge"] for q in train} & {q["bridge"] for q in test}  # split by bridge
    articles = {d["title"].lower(): d["text"].lower() for d in load_corpus()}
    for q in train + test:
        first, second = articles[q["subject"].lower()], articles[q["bridge"].lower()]
        assert q["bridge"].lower() in first, q
        assert any(gold.lower() in second for gold in q["answers"]), q
        assert not any(gold.lower() in first for gold in q["answers"]), q
    q = next(q for q in test if "citizenship of Mohammad-Reza Shajarian" in q["question"])
    assert (q["question"], q["answers"], q["bridge"]) == (
        "What is the capital of the country of citizenship of Mohammad-Reza Shajarian?",
        ["Tehran"],
        "Iran",
    )
    with pytest.raises(ValueError, match="hops"):
        load_questions("test", hops=3)


def test_one_search_of_a_two_hop_question_rarely_finds_the_bridge_article():
    """BM25's top 3 for the question text holds the bridge's article (where the answer is) for
    11% of the test questions: most need the second search (benchmarks/retrieval.py reports it)."""
    index = BM25Index.load_or_build()
    test = load_questions("test", hops=2)
    assert bridge_recall(index, test, 3) == pytest.approx(25 / 227)


def test_answer_prior_by_hand_and_on_the_two_hop_split():
    """A policy that never searches and answers each outer relation's commonest train answer: by
    hand on five questions, then on the real split, where it gets 107 of the 227 test questions
    right (every "basic form of government" is "republic", every "currency" "euro")."""

    def q(outer, inner, answer):
        return {"question": f"What is the {outer} of the {inner} of X?", "answers": [answer]}

    train = [
        q("currency", "country", "euro"),
        q("currency", "country of citizenship", "euro"),
        q("capital", "country", "Rome"),
    ]
    train.append(q("basic form of government", "country", "republic"))
    test = [q("currency", "country", "Euro"), q("capital", "country", "Paris"), q("continent", "country", "Asia")]
    test.append(q("basic form of government", "country of origin", "republic"))
    assert answer_prior(train, test) == 2 / 4  # euro (normalised) and republic; Rome is wrong, continent unseen
    assert answer_prior(load_questions("train", hops=2), load_questions("test", hops=2)) == pytest.approx(107 / 227)
    with pytest.raises(ValueError, match="at least one"):
        answer_prior(train, [])


def test_two_hop_oracle_searches_twice_and_answers_every_test_question(service):
    """The oracle searches the subject (the results name the bridge), then the bridge (the results
    hold a gold answer), then answers: EM 1.0 with exactly two searches on every test question."""
    env = gym.make("rl2/MultiHopQA-v0", split="test", retrieval_url=service).unwrapped
    solve = env.make_solver()
    for index in range(len(env)):
        observation, _ = env.reset(options={"index": index})
        results = []
        for _ in range(2):
            observation, reward, terminated, _, _ = env.step(solve(observation))
            assert not terminated and observation.startswith("<information>")
            results.append(observation.lower())
        assert env.item["bridge"].lower() in results[0]
        assert any(gold.lower() in results[1] for gold in env.item["answers"])
        _, reward, terminated, _, info = env.step(solve(observation))
        assert terminated and reward == 1.0 and info["num_searches"] == 2
    env.close()
