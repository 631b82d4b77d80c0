"""The env server (rl2gem.serving.env_server, python -m rl2gem.envserver) and rl2/Remote-v0.

Servers run in this process on a loopback port, in a thread with their own event loop, so the
synchronous Gymnasium API of the client can be used from the test."""

import asyncio
import contextlib
import copy
import gc
import json
import pickle
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings

import aiohttp
import gymnasium as gym
import pytest
from aiohttp import web
from helpers import serving
from toy_envs import SlowResetEnv

import rl2gem
from rl2gem.env_protocol import json_safe
from rl2gem.remote import RemoteEnv
from rl2gem.serving.env_server import SESSIONS, make_env_app
from rl2gem.testing import check_env

GAME = "rl2/GuessTheNumber-v0"


@contextlib.contextmanager
def serving_env(env_id, env_kwargs=None, **options):
    """``env_id`` served on a free loopback port; yields its URL and the app."""
    app = make_env_app(env_id, env_kwargs, **options)
    with serving(app) as url:
        yield url, app


def call(url, method="GET", body=None, raw=None):
    """(status, JSON body) of one HTTP call; ``raw`` bytes are sent as they are."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def play(env, seed, actions):
    """The JSON form of an episode's reset and steps (what a client can see of it)."""
    out = [json_safe(env.reset(seed=seed))]
    for action in actions:
        result = env.step(action)
        out.append(json_safe(result))
        if result[2] or result[3]:
            break
    return out


@pytest.fixture(scope="module")
def game_url():
    with serving_env(GAME) as (url, _):
        yield url


def test_a_remote_episode_equals_the_local_envs(game_url):
    """Observations, rewards, both flags and every info entry (role, turn, seed, invalid-action
    counts), over a won game, a lost one and one with a malformed guess."""
    local, remote = rl2gem.make(GAME), gym.make("rl2/Remote-v0", url=game_url)
    for seed, actions in [
        (3, [f"\\boxed{{{n}}}" for n in range(1, 51)]),  # counts up: wins or runs out of turns
        (4, ["\\boxed{50}", "no number here", "", "\\boxed{25}", "\\boxed{75}"] + ["\\boxed{1}"] * 10),
    ]:
        assert play(remote, seed, actions) == play(local, seed, actions)
    _, info = remote.reset()  # unseeded: the seed it reports replays the episode
    assert remote.reset(seed=info["seed"])[0] == local.reset(seed=info["seed"])[0]
    remote.close()
    local.close()


@pytest.mark.parametrize(
    "env_id, env_kwargs",
    [
        ("rl2/GSM8K-v0", {"split": "test"}),  # single-turn math
        ("rl2/SearchQA-v0", {"topk": 1}),  # multi-turn, search results as tool turns
        ("rl2/PythonMath-v0", {}),  # tool calls into the sandbox
        (GAME, {}),  # a game
    ],
)
def test_check_env_passes_on_a_served_env_of_each_kind(env_id, env_kwargs):
    """check_env(URL): the server's routes, refusals and session isolation, then every check of a
    local env on RemoteEnv clients."""
    with serving_env(env_id, env_kwargs) as (url, app), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(url)
        gc.collect()
        deadline = time.monotonic() + 10
        while app[SESSIONS].sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not app[SESSIONS].sessions  # every client closed its session
    assert not [w for w in caught if "Unclosed" in str(w.message)]  # nor left an HTTP session open


def test_check_env_fails_a_server_that_breaks_the_contract(game_url):
    """A server that answers a bad request with a 200 fails check_env (here: a proxy of the game
    server that drops the refusal of a negative seed)."""

    async def lenient_reset(request):
        body = await request.json()
        body["seed"] = abs(body.get("seed") or 0)
        async with aiohttp.ClientSession() as client, client.post(f"{game_url}/reset", json=body) as answer:
            return web.json_response(await answer.json(), status=answer.status)

    async def forward(request):
        async with (
            aiohttp.ClientSession() as client,
            client.request(request.method, f"{game_url}{request.path_qs}", data=await request.read()) as answer,
        ):
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/reset", lenient_reset), web.route("*", "/{tail:.*}", forward)])
    with serving(app) as url, pytest.raises(AssertionError, match="POST /reset .* answered 200"):
        check_env(url)


def test_a_vector_env_over_the_server_equals_the_local_one(game_url):
    async def episode(venv):
        observations, infos = await venv.areset(seed=11)
        out = [(observations, [i["seed"] for i in infos])]
        for guess in (50, 25, 75):
            observations, rewards, terminated, truncated, infos = await venv.astep(
                [f"\\boxed{{{guess}}}"] * venv.num_envs
            )
            out.append((observations, list(rewards), list(terminated), [i.get("turn") for i in infos]))
        await venv.aclose()
        return out

    remote = asyncio.run(episode(rl2gem.make_vec("rl2/Remote-v0", num_envs=64, url=game_url)))  # 64 sessions
    assert remote == asyncio.run(episode(rl2gem.make_vec(GAME, num_envs=64)))


def test_a_served_searchqa_replays_the_solvers_episodes_exactly():
    """100 episodes of the oracle solver (what ``collect policy=solver`` plays) on the local
    SearchQA, then the same seeds and actions through rl2/Remote-v0: the same observations (search
    results as tool turns), rewards, flags and info (em, f1, num_searches, role, turn, seed)."""
    with serving_env("rl2/SearchQA-v0", {"topk": 1, "split": "test"}) as (url, _):
        local = rl2gem.make("rl2/SearchQA-v0", topk=1, split="test")
        remote = gym.make("rl2/Remote-v0", url=url, topk=1, split="test")
        solve = local.unwrapped.make_solver()
        searched = 0
        for seed in range(100):
            observation, _ = local.reset(seed=seed)
            actions, done = [], False
            while not done:
                actions.append(solve(observation))
                observation, _, terminated, truncated, _ = local.step(actions[-1])
                done = terminated or truncated
            searched += any(action.startswith("<search>") for action in actions)
            assert play(remote, seed, actions) == play(local, seed, actions), seed
        assert searched == 100
        # the same search as a tool on the JSON-RPC /mcp route (OpenEnv's MCP endpoint)
        listing = call(f"{url}/mcp", "POST", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})[1]
        assert [tool["name"] for tool in listing["result"]["tools"]] == ["search"]
        request = {"name": "search", "arguments": {"query": "Afghanistan"}}
        status, reply = call(
            f"{url}/mcp", "POST", {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": request}
        )
        observation, _ = local.reset(seed=0)
        observation, *_ = local.step("<search>Afghanistan</search>")
        assert status == 200 and reply["id"] == 2 and not reply["result"]["isError"]
        assert f"<information>{reply['result']['content'][0]['text']}</information>" == observation
        bad = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "search", "arguments": {}}}
        assert call(f"{url}/mcp", "POST", bad)[1]["result"]["isError"]
        bad["params"] = ["search"]
        assert call(f"{url}/mcp", "POST", bad)[1]["error"]["code"] == -32602
        remote.close()
        local.close()


def test_env_kwargs_and_the_split_reach_the_served_env():
    with serving_env("rl2/GSM8K-v0") as (url, app):
        remote = gym.make("rl2/Remote-v0", url=url, split="test")
        observation, _ = remote.reset(seed=0, options={"index": 5})
        assert observation == rl2gem.make("rl2/GSM8K-v0", split="test").reset(seed=0, options={"index": 5})[0]
        (session,) = app[SESSIONS].sessions.values()
        assert session.env_kwargs == {"split": "test"}
        remote.close()
        assert not app[SESSIONS].sessions  # close() ended the session on the server


def test_tools_left_to_the_template_reach_a_served_tool_env_and_not_one_without_tools():
    """evaluate through an API and ``rollout.tools_in_template`` make envs with ``tool_prompt=None``
    (standard_kwargs): a served tool env got it too late, and its tools came twice (text and API)."""
    kwargs = rl2gem.standard_kwargs("rl2/Remote-v0", {}, split="test", tools_in_template=True)
    assert kwargs == {"split": "test", "tool_prompt": None}
    with serving_env("rl2/PythonMath-v0") as (url, app):
        remote = gym.make("rl2/Remote-v0", url=url, **kwargs)
        observation, info = remote.reset(seed=0)
        assert "<tools>" not in observation and [tool["function"]["name"] for tool in info["tools"]] == ["python"]
        (session,) = app[SESSIONS].sessions.values()
        assert session.env_kwargs == {"split": "test", "tool_prompt": None}
        remote.close()
        default = gym.make("rl2/Remote-v0", url=url)
        assert "<tools>" in default.reset(seed=0)[0]  # not given: the server's own (the text has them)
        default.close()
    with serving_env(GAME) as (url, app):
        remote = gym.make("rl2/Remote-v0", url=url, **kwargs)
        remote.reset(seed=0)  # a game has neither argument: both dropped
        (session,) = app[SESSIONS].sessions.values()
        assert session.env_kwargs == {}
        remote.close()


def test_an_mcp_client_uses_the_env_servers_mcp_route():
    """The MCP SDK's Streamable HTTP client (MCPServerTools) on ``/mcp``: its ``initialize``
    handshake was 'Method not found', so only OpenEnv's bare JSON-RPC calls worked there."""
    from rl2gem.tools.mcp import MCPServerTools

    with serving_env("rl2/PythonMath-v0") as (url, _):
        server = MCPServerTools(f"{url}/mcp", timeout=60)
        try:
            (python,) = server.tools()
            assert python.name == "python"
            text = asyncio.run(python.call({"code": "print(6 * 7)"}))
            assert text.strip() == "42"
        finally:
            server.close()
        assert call(f"{url}/mcp", "POST", {"jsonrpc": "2.0", "method": "notifications/initialized"}) == (202, None)


def test_bad_requests_get_4xx_with_an_error_body_and_the_server_goes_on(game_url):
    status, body = call(f"{game_url}/reset", "POST", {"seed": 1})
    assert status == 200 and body["done"] is False and isinstance(body["observation"]["message"], str)
    session = body["session_id"]
    cases = [
        ("/step", "POST", None, b"{not json", 400, "bad_json"),
        ("/step", "POST", {"action": {"message": "\\boxed{5}"}}, None, 400, "missing_session_id"),
        ("/step", "POST", {"session_id": "nope", "action": {"message": "x"}}, None, 404, "unknown_session"),
        ("/step", "POST", {"session_id": session}, None, 400, "missing_action"),
        ("/step", "POST", {"session_id": session, "action": {"message": 7}}, None, 422, "bad_action"),
        ("/step", "POST", {"session_id": session, "action": ["a"]}, None, 422, "bad_action"),
        ("/reset", "POST", {"seed": -1}, None, 422, "bad_seed"),
        ("/reset", "POST", {"options": "index"}, None, 422, "bad_options"),
        ("/reset", "POST", {"env_kwargs": {"no_such_kwarg": 1}}, None, 422, "bad_env_kwargs"),
        ("/state?session_id=nope", "GET", None, None, 404, "unknown_session"),
        ("/no/such/route", "GET", None, None, 404, "http_404"),
        ("/reset", "GET", None, None, 405, "http_405"),
    ]
    for path, method, body, raw, status, code in cases:
        got_status, got = call(game_url + path, method, body, raw)
        assert (got_status, got["code"]) == (status, code), (path, body, got)
        assert isinstance(got["detail"], str) and got["detail"]
    # the session is intact: a winning line ends the episode, and a step after it is a 409
    remote_state = call(f"{game_url}/state?session_id={session}")[1]
    assert remote_state["step_count"] == 0 and remote_state["done"] is False
    target = rl2gem.make(GAME).unwrapped
    target.reset(seed=1)  # the same task as the session's
    winning = {"session_id": session, "action": {"message": f"\\boxed{{{target.target}}}"}}
    status, body = call(f"{game_url}/step", "POST", winning)
    assert status == 200 and body["done"] is True and body["reward"] == 1.0
    status, body = call(f"{game_url}/step", "POST", {"session_id": session, "action": {"message": "\\boxed{1}"}})
    assert (status, body["code"]) == (409, "episode_over")
    assert call(f"{game_url}/health") == (200, {"status": "healthy"})


def test_a_retried_step_is_answered_once_and_not_taken_twice(game_url):
    session = call(f"{game_url}/reset", "POST", {"seed": 2})[1]["session_id"]
    step = {"session_id": session, "action": {"message": "\\boxed{50}"}, "request_id": "r1"}
    first, again = call(f"{game_url}/step", "POST", step), call(f"{game_url}/step", "POST", step)
    assert first == again and first[1]["observation"]["info"]["turn"] == 1
    assert call(f"{game_url}/state?session_id={session}")[1]["step_count"] == 1
    second = call(f"{game_url}/step", "POST", {**step, "request_id": "r2"})[1]
    assert second["observation"]["info"]["turn"] == 2


def test_sessions_are_isolated_capped_and_expire():
    with serving_env(GAME, max_sessions=2, session_timeout=0.5) as (url, app):
        a, b = (call(f"{url}/reset", "POST", {"seed": seed})[1] for seed in (5, 6))
        assert a["session_id"] != b["session_id"]
        status, body = call(f"{url}/reset", "POST", {"seed": 7})
        assert (status, body["code"]) == (503, "capacity_reached")
        call(f"{url}/step", "POST", {"session_id": a["session_id"], "action": {"message": "\\boxed{50}"}})
        assert call(f"{url}/state?session_id={a['session_id']}")[1]["step_count"] == 1
        assert call(f"{url}/state?session_id={b['session_id']}")[1]["step_count"] == 0  # b's episode untouched
        remote = RemoteEnv(url)
        deadline = time.monotonic() + 10
        while app[SESSIONS].sessions and time.monotonic() < deadline:  # the reaper runs every second
            time.sleep(0.1)
        assert not app[SESSIONS].sessions
        assert call(f"{url}/state?session_id={a['session_id']}")[0] == 404
        remote.reset(seed=1)  # a session for the client; expired ones left room
        time.sleep(2.5)  # expires too: the next reset opens a new session and goes on
        observation, info = remote.reset(seed=1)
        assert observation and "error" not in info and remote.session_id in app[SESSIONS].sessions
        remote.close()


def test_an_unreachable_server_truncates_the_episode_with_an_error():
    with serving_env(GAME) as (url, _):
        remote = RemoteEnv(url, retries=1, backoff=0.01, timeout=5)
        remote.reset(seed=0)
    # the server is gone: the step is retried, then the episode ends as truncated with the error
    observation, reward, terminated, truncated, info = remote.step("\\boxed{50}")
    assert (observation, reward, terminated, truncated) == ("", 0.0, False, True)
    assert "after 2 tries" in info["error"] and info["truncated_reason"] == "remote_error"
    observation, info = remote.reset(seed=0)
    assert observation == "" and "Connect" in info["error"]
    assert remote.step("\\boxed{50}")[3] is True
    remote.close()


def test_the_websocket_speaks_openenvs_messages(game_url):
    async def session():
        async with aiohttp.ClientSession() as client, client.ws_connect(game_url.replace("http", "ws") + "/ws") as ws:
            replies = []
            for message in (
                {"type": "reset", "data": {"seed": 3}},
                {"type": "step", "data": {"message": "\\boxed{50}"}},
                {"type": "state"},
                {"type": "step", "data": {"message": 5}},
                {"type": "dance"},
            ):
                await ws.send_json(message)
                replies.append(await ws.receive_json())
            await ws.send_str("{oops")
            replies.append(await ws.receive_json())
            await ws.send_json({"type": "close"})
            return replies

    reset, step, state, bad_action, unknown, bad_json = asyncio.run(session())
    local = rl2gem.make(GAME)
    assert reset == {"type": "observation", "data": json_safe(_envelope(local.reset(seed=3)))}
    assert step["data"]["observation"]["message"] == local.step("\\boxed{50}")[0]
    assert state["type"] == "state" and state["data"]["step_count"] == 1 and state["data"]["seed"] == 3
    assert [r["data"]["code"] for r in (bad_action, unknown, bad_json)] == [
        "VALIDATION_ERROR",
        "UNKNOWN_TYPE",
        "INVALID_JSON",
    ]


def _envelope(reset_result):
    observation, info = reset_result
    return {
        "observation": {"message": observation, "terminated": False, "truncated": False, "info": info},
        "reward": None,
        "done": False,
    }


def test_what_openenv_validate_checks(game_url):
    """The six checks of ``openenv validate URL`` (openenv-core 0.2), as it makes them."""
    status, openapi = call(f"{game_url}/openapi.json")
    assert status == 200 and openapi["info"]["version"].startswith("1.")
    assert call(f"{game_url}/health") == (200, {"status": "healthy"})
    status, metadata = call(f"{game_url}/metadata")
    assert status == 200 and metadata["name"] == GAME and isinstance(metadata["description"], str)
    status, schema = call(f"{game_url}/schema")
    assert status == 200 and all(isinstance(schema[k], dict) for k in ("action", "observation", "state"))
    assert schema["action"]["required"] == ["message"] and schema["max_turns"] == 7
    assert schema["kwargs"]["difficulty"] == {"default": None, "required": False}  # the env's kwargs
    status, reply = call(f"{game_url}/mcp", "POST", {})
    assert status == 200 and reply["jsonrpc"] == "2.0" and reply["error"]["code"] == -32600
    paths = openapi["paths"]
    assert {"/reset", "/step", "/state"} <= set(paths) and "post" in paths["/step"]  # simulation mode


def test_the_command_line_serves_and_refuses_a_bad_env_in_one_line():
    bad = subprocess.run(
        [sys.executable, "-m", "rl2gem.envserver", "rl2/NoSuchEnv-v0"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("config error: rl2/NoSuchEnv-v0:")
    assert len(bad.stderr.strip().splitlines()) == 1
    server = subprocess.Popen(
        [sys.executable, "-m", "rl2gem.envserver", GAME, "--port", "0", "--exit-on-stdin-eof", "difficulty=easy"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().split()[-1]
        remote = RemoteEnv(url)
        observation, _ = remote.reset(seed=0)
        assert observation == rl2gem.make(GAME, difficulty="easy").reset(seed=0)[0]
        remote.close()
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    assert server.returncode == 0


def test_a_remote_env_copies_outside_an_episode_and_refuses_inside_one(game_url):
    """The episode lives on the server: a copy that shared its session would step the original's
    game. Before the first reset and after close, a copy makes its own session and plays alone."""
    env = RemoteEnv(game_url)
    twin = copy.deepcopy(env)
    obs, info = env.reset(seed=3)
    with pytest.raises(TypeError, match=f"session {env._session_id} is open"):
        copy.deepcopy(env)
    with pytest.raises(TypeError, match="the episode lives on the server"):
        pickle.dumps(env)
    assert twin.reset(seed=3) == (obs, info) and twin._session_id != env._session_id
    assert twin.step("50") == env.step("50")
    env.close()
    again = pickle.loads(pickle.dumps(env))
    assert again.reset(seed=3)[0] == obs
    for e in (again, twin):
        e.close()


def test_a_new_session_whose_first_reset_is_refused_is_closed():
    """The client of a refused first reset never learns the session's id: the server closes it (it
    stayed open, so refused resets filled ``max_sessions`` and good ones got 503)."""
    with serving_env("rl2/GSM8K-v0", max_sessions=2) as (url, app):
        for _ in range(3):
            status, body = call(f"{url}/reset", "POST", {"options": {"index": 10**9}})
            assert (status, body["code"]) == (422, "bad_reset")
        assert not app[SESSIONS].sessions
        status, body = call(f"{url}/reset", "POST", {"seed": 0})
        assert status == 200 and len(app[SESSIONS].sessions) == 1


def test_an_idle_websocket_keeps_its_session():
    """A WebSocket's session closes with its connection, never for idling: the reaper closed it
    under the open connection, whose next step ran on a closed env."""
    with serving_env(GAME, session_timeout=0.5) as (url, app):

        async def session():
            async with aiohttp.ClientSession() as client, client.ws_connect(url.replace("http", "ws") + "/ws") as ws:
                await ws.send_json({"type": "reset", "data": {"seed": 3}})
                await ws.receive_json()
                await asyncio.sleep(2.5)  # idle past the timeout; the reaper runs every second
                kept = len(app[SESSIONS].sessions)
                await ws.send_json({"type": "step", "data": {"message": "\\boxed{50}"}})
                return kept, await ws.receive_json()

        kept, step = asyncio.run(session())
        assert kept == 1 and step["type"] == "observation" and step["data"]["observation"]["message"]
        deadline = time.monotonic() + 10
        while app[SESSIONS].sessions and time.monotonic() < deadline:  # the handler closes it as the socket closes
            time.sleep(0.05)
        assert not app[SESSIONS].sessions


def test_a_retried_reset_opens_one_session():
    """A RemoteEnv reset whose first try timed out is retried with the same request id: the server
    answers it with the session the first try opened (awaiting that reset), not a second session
    (each lost answer left a session open until it expired)."""
    rl2gem.register("testlab/SlowReset-v0", "toy_envs:SlowResetEnv", reset_latency=1.0)
    try:
        with serving_env("testlab/SlowReset-v0") as (url, app):
            SlowResetEnv.resets = 0
            remote = RemoteEnv(url, timeout=0.4, retries=4, backoff=0.05)
            observation, info = remote.reset(seed=3)
            assert "error" not in info and observation.startswith("Count to")
            assert list(app[SESSIONS].sessions) == [remote.session_id] and SlowResetEnv.resets == 1
            observation, _ = remote.reset(seed=4)  # a later reset of that session is a new episode
            assert SlowResetEnv.resets == 2 and list(app[SESSIONS].sessions) == [remote.session_id]
            remote.close()
            status, first = call(f"{url}/reset", "POST", {"seed": 1, "request_id": "same"})
            again = call(f"{url}/reset", "POST", {"seed": 1, "request_id": "same"})[1]
            assert status == 200 and again == first and len(app[SESSIONS].sessions) == 1
            call(f"{url}/close", "POST", {"session_id": first["session_id"]})
            status, third = call(f"{url}/reset", "POST", {"seed": 1, "request_id": "same"})
            assert status == 200 and third["session_id"] != first["session_id"]  # the first session is closed
    finally:
        del gym.registry["testlab/SlowReset-v0"]


def test_a_remote_data_set_env_has_its_splits_size_and_evaluation_plays_its_items_in_order():
    """A served data-set env looked like a seed-only env to evaluation (RemoteEnv had no ``len``):
    its resets drew items at random, with replacement (516 SearchQA test episodes played 323 items)."""
    from rl2gem.evaluation import task_resets

    local = {split: len(rl2gem.make("rl2/GSM8K-v0", split=split).unwrapped) for split in ("train", "test")}
    assert local["train"] != local["test"]
    with serving_env("rl2/GSM8K-v0") as (url, _):
        for split, size in local.items():
            assert len(RemoteEnv(url, split=split)) == size
        kwargs = {"url": url, "split": "test"}
        assert task_resets("rl2/Remote-v0", kwargs, 3, seed=5) == [(5 + i, {"index": i}) for i in range(3)]
        remote = RemoteEnv(url, split="test")
        _, info = remote.reset(seed=0, options={"index": local["test"] - 1})
        assert info["index"] == local["test"] - 1
        remote.close()
        assert call(f"{url}/schema?env_kwargs=[1]")[0] == 400
    with serving_env(GAME) as (url, _):
        with pytest.raises(TypeError, match="has no data set"):
            len(RemoteEnv(url))
        assert task_resets("rl2/Remote-v0", {"url": url}, 2, seed=5) == [(5, None), (6, None)]


def test_schema_builds_for_env_kwargs_are_shared_and_take_a_session_slot(monkeypatch):
    """Every RemoteEnv's first reset asks /schema?env_kwargs=: concurrent ones each built and closed
    an env of their own, outside max_sessions (any client could make the server build any number)."""
    from rl2gem.serving.env_server import EnvSessions

    builds = []
    make_env = EnvSessions.make_env

    async def counted(self, overrides):
        builds.append(dict(overrides or {}))
        await asyncio.sleep(0.2)  # the requests below arrive while it builds
        return await make_env(self, overrides)

    monkeypatch.setattr(EnvSessions, "make_env", counted)
    with serving_env("rl2/GSM8K-v0", max_sessions=1) as (url, _):
        query = f"{url}/schema?env_kwargs=" + urllib.parse.quote(json.dumps({"split": "test"}))

        async def four():
            async with aiohttp.ClientSession() as client:

                async def get():
                    async with client.get(query) as answer:
                        return answer.status, await answer.json()

                return await asyncio.gather(*(get() for _ in range(4)))

        answers = asyncio.run(four())
        assert [status for status, _ in answers] == [200] * 4 and len(builds) == 1
        assert len({json.dumps(body, sort_keys=True) for _, body in answers}) == 1
        session = call(f"{url}/reset", "POST", {"seed": 0})[1]["session_id"]  # the one slot taken
        other = f"{url}/schema?env_kwargs=" + urllib.parse.quote(json.dumps({"split": "train"}))
        assert call(other)[0] == 503 and len(builds) == 2  # the session's build, none for the schema
        call(f"{url}/close", "POST", {"session_id": session})
        assert call(other)[0] == 200
