"""The embedded server speaks SGLang's native API (real processes on 127.0.0.1)."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch
from aiohttp import web
from helpers import serving
from tiny import tiny_model

from rl2gem.rollout import HTTPEngine
from rl2gem.serving import launch


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = launch(str(tiny_model_dir), threads=1)
    yield srv
    srv.stop()


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read().decode() or "null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null")


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def test_generate_answers_in_sglangs_format(server):
    model = tiny_model()
    prompt = [1, 1000, 2000, 3000]
    status, body = post(
        server.url + "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert status == 200
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=2)[
        0, 4:
    ].tolist()
    assert body["output_ids"] == ref
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert [x[1] for x in meta["output_token_logprobs"]] == ref
    assert all(isinstance(x[0], float) and x[0] <= 0 for x in meta["output_token_logprobs"])
    assert isinstance(body["text"], str) and meta["weight_version"] == "0"
    # batch form
    status, batch = post(
        server.url + "/generate", {"input_ids": [prompt, prompt[:2]], "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200 and len(batch) == 2 and all(len(b["output_ids"]) <= 2 for b in batch)


def test_bad_requests_get_400_with_a_message(server):
    for body in (
        {"input_ids": []},
        {"input_ids": [1, "x"]},
        {"input_ids": [1, 2], "sampling_params": {"temprature": 1}},
        {"input_ids": [1, 10**7]},
    ):
        status, ans = post(server.url + "/generate", body)
        assert status == 400 and ans["error"]["message"]
    status, ans = post(server.url + "/generate", b"{not json", raw=True)
    assert status == 400
    status, ans = post(server.url + "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert status == 400 and ans["success"] is False


def test_info_load_and_health_endpoints(server):
    assert urllib.request.urlopen(server.url + "/health", timeout=5).status == 200
    load = get(server.url + "/get_load")
    assert (
        isinstance(load, list)
        and load[0]["dp_rank"] == 0
        and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    )
    info = get(server.url + "/get_model_info")
    assert info["is_generation"] is True and "weight_version" in info
    sinfo = get(server.url + "/get_server_info")
    assert sinfo["context_length"] == 2048 and "internal_states" in sinfo


def test_client_pause_abort_continue_and_weight_update_from_disk(server, tmp_path):
    other = tiny_model(seed=5)
    other.save_pretrained(tmp_path)
    seq = [1, 5, 6, 7, 8, 9]
    with torch.no_grad():
        ref = (
            torch.log_softmax(other(torch.tensor([seq])).logits[0, :-1], -1)
            .gather(1, torch.tensor(seq[1:])[:, None])
            .flatten()
        )

    async def main():
        eng = HTTPEngine(server.url)
        assert await eng.health()
        long = asyncio.ensure_future(eng.generate([1, 2, 3], {"max_new_tokens": 1900, "ignore_eos": True}))
        await asyncio.sleep(0.5)
        await eng.pause()
        partial = await long
        queued = asyncio.ensure_future(eng.generate([1, 2, 3], {"max_new_tokens": 2}))
        await asyncio.sleep(0.3)
        waited = not queued.done()
        version = await eng.update_weights(str(tmp_path))
        await eng.resume()
        done = await queued
        scored = await eng.generate(seq, {"max_new_tokens": 1}, logprob_start_len=1)
        # abort by rid
        t = asyncio.ensure_future(eng.generate([1, 2], {"max_new_tokens": 1900, "ignore_eos": True}, rid="xyz"))
        await asyncio.sleep(0.3)
        await eng.abort("xyz")
        aborted = await t
        await eng.close()
        return partial, waited, version, done, scored, aborted

    partial, waited, version, done, scored, aborted = asyncio.run(main())
    assert partial.aborted and 0 < len(partial.output_ids) < 1900
    assert waited and len(done.output_ids) == 2 and done.weight_version == version == 1
    assert scored.weight_version == 1
    assert torch.allclose(torch.tensor(scored.input_logprobs), ref, atol=1e-4)
    assert aborted.aborted and aborted.meta["id"] == "xyz"


def test_state_dict_weight_sync_through_disk(server):
    trainer = tiny_model(seed=9)
    seq = [1, 50, 60, 70]
    with torch.no_grad():
        ref = (
            torch.log_softmax(trainer(torch.tensor([seq])).logits[0, :-1], -1)
            .gather(1, torch.tensor(seq[1:])[:, None])
            .flatten()
        )

    async def main():
        eng = HTTPEngine(server.url)
        eng.weight_version = 10
        v = await eng.update_weights(trainer.state_dict())
        out = await eng.generate(seq, {"max_new_tokens": 1}, logprob_start_len=1)
        await eng.close()
        return v, out

    v, out = asyncio.run(main())
    assert v == 11 and out.weight_version == 11
    assert torch.allclose(torch.tensor(out.input_logprobs), ref, atol=1e-4)


def test_sglang_engine_shares_the_client_and_launch_needs_sglang(server, monkeypatch):
    import sys

    from rl2gem.rollout.engines.sglang import SGLangEngine, sglang_server_command

    async def main():
        eng = SGLangEngine(server.url)
        out = await eng.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})
        v = await eng.update_weights(tiny_model().state_dict())  # CPU tensors: through disk
        await eng.close()
        return out, v

    out, v = asyncio.run(main())
    assert len(out.output_ids) == 3 and v >= 1
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="rl2gem\\[gpu\\]"):
        SGLangEngine.launch("some/model")
    cmd = sglang_server_command("m", 31000, base_gpu_id=2, tp_size=2)
    assert (
        cmd[1:3] == ["-m", "sglang.launch_server"] and "--base-gpu-id" in cmd and cmd[cmd.index("--tp-size") + 1] == "2"
    )


def test_lora_adapter_sync_merges_peft_adapters_and_requests_name_them(server, tmp_path):
    """HTTPEngine.update_lora_adapter (adapter-only sync, SGLang's /load_lora_adapter): the server's
    log-probs become those of peft's own PeftModel with that adapter; a second adapter replaces the
    first (not stacked on it); unloading gives the base model back; a request that does not name
    the loaded adapter is refused."""
    from peft import LoraConfig, get_peft_model

    seq = [1, 50, 60, 70, 80, 90]

    def adapter(seed):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(tiny_model(), config).eval()
        model.save_pretrained(tmp_path / f"adapter{seed}")  # peft's writer, not ours
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        return tmp_path / f"adapter{seed}", torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[
            :, 0
        ]

    first, first_ref = adapter(1)
    second, second_ref = adapter(2)
    with torch.no_grad():
        base_ref = torch.log_softmax(tiny_model()(torch.tensor([seq])).logits[0, :-1], -1)
        base_ref = base_ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert float((first_ref - base_ref).abs().max()) > 1e-2  # the adapters change the model

    async def main():
        eng = HTTPEngine(server.url)
        scored = []
        for path in (first, second):
            version = await eng.update_lora_adapter(path)
            out = await eng.generate(seq, {"max_new_tokens": 1}, logprob_start_len=1)
            scored.append((version, eng.lora_name, out))
        refused = post(server.url + "/generate", {"input_ids": seq, "sampling_params": {"max_new_tokens": 1}})
        status, answer = post(server.url + "/unload_lora_adapter", {"lora_name": eng.lora_name})
        eng.lora_name = None
        base = await eng.generate(seq, {"max_new_tokens": 1}, logprob_start_len=1)
        with pytest.raises(ValueError, match="adapter_config.json"):
            await eng.update_lora_adapter(tmp_path / "missing")
        await eng.close()
        return scored, refused, (status, answer), base

    scored, refused, unloaded, base = asyncio.run(main())
    (v1, name1, out1), (v2, name2, out2) = scored
    assert v2 == v1 + 1 and (name1, name2) == (f"rl2gem-v{v1}", f"rl2gem-v{v2}")
    torch.testing.assert_close(torch.tensor(out1.input_logprobs), first_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(out2.input_logprobs), second_ref, atol=1e-4, rtol=0)
    assert refused[0] == 400 and "lora_path" in refused[1]["error"]["message"]
    assert unloaded[0] == 200 and unloaded[1]["success"]
    torch.testing.assert_close(torch.tensor(base.input_logprobs), base_ref, atol=1e-4, rtol=0)


def test_a_generate_that_timed_out_is_aborted_before_it_is_sent_again():
    """HTTPEngine: a /generate with no answer within the timeout is aborted on every worker under its
    request id, and the retry runs under a new id (a server that never notices the client left would
    otherwise run both copies); engine.abort(rid) reaches the attempt that is running."""
    seen: list[tuple[str, str]] = []  # (route, rid) as the server got them
    release = asyncio.Event()

    async def generate(request):
        body = await request.json()
        seen.append(("generate", body["rid"]))
        if len([r for r in seen if r[0] == "generate"]) == 1:
            await asyncio.sleep(30)  # the first attempt never answers in time
        else:
            await release.wait()
        return web.json_response({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}})

    async def abort(request):
        seen.append(("abort", (await request.json())["rid"]))
        if len([r for r in seen if r[0] == "abort"]) == 2:
            release.set()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    with serving(app) as url:

        async def main():
            engine = HTTPEngine(url, timeout=0.5, retries=1, backoff=0.01)
            task = asyncio.ensure_future(engine.generate([1, 2], {"max_new_tokens": 1}, rid="job-7"))
            while len([r for r in seen if r[0] == "generate"]) < 2:
                await asyncio.sleep(0.02)
            await engine.abort("job-7")  # the caller's id reaches the retry's
            out = await task
            await engine.close()
            return out

        out = asyncio.run(main())
    assert out.output_ids == [5]
    generates = [rid for route, rid in seen if route == "generate"]
    aborts = [rid for route, rid in seen if route == "abort"]
    assert generates[0] == "job-7" and len(generates) == 2
    # SGLang aborts every request whose id starts with the one given: no attempt's id may start another's
    assert not generates[1].startswith(generates[0]) and not generates[0].startswith(generates[1])
    assert sorted(aborts) == sorted(["job-7", generates[1]])  # the first copy's abort runs in the background
