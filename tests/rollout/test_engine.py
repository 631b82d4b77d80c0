import asyncio
import time

import pytest
import torch
from helpers import admitted_together
from tiny import tiny_model

from rl2gem.devices import OperationCounter
from rl2gem.rollout.engines import embedded
from rl2gem.rollout.engines.base import SamplingParams
from rl2gem.rollout.engines.embedded import EmbeddedEngine


def run(coro):
    return asyncio.run(coro)


def teacher_logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(1, torch.tensor(output)[:, None]).flatten()


PROMPTS = [[1, 100 + i, 200 + 3 * i, 300 + 7 * i][: 2 + i % 3] + list(range(400, 400 + i)) for i in range(10)]


def test_greedy_matches_model_generate_under_staggered_arrivals(model):
    ref = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=2)
        ref.append(out[0, len(p) :].tolist())

    async def main():
        eng = EmbeddedEngine(model, max_batch_size=4)

        async def one(i, p):
            await asyncio.sleep(0.01 * (i % 4))
            return await eng.generate(p, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})

        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        stats = dict(eng.stats)
        await eng.close()
        return outs, stats

    outs, stats = run(main())
    assert [o.output_ids for o in outs] == ref
    assert all(o.finish_reason == {"type": "length", "length": 12} for o in outs)
    # more requests than slots: admitted in several prefills, decoded together
    assert stats["prefill_forwards"] >= 3 and stats["decode_steps"] < 10 * 11


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_output_logprobs_equal_teacher_forced(model, temperature):
    async def main():
        eng = EmbeddedEngine(model, seed=1)
        outs = await asyncio.gather(
            *(
                eng.generate(p, {"max_new_tokens": 10 + i, "temperature": temperature, "ignore_eos": True})
                for i, p in enumerate(PROMPTS)
            )
        )
        await eng.close()
        return outs

    for p, o in zip(PROMPTS, run(main()), strict=True):
        ref = teacher_logprobs(model, p, o.output_ids, temperature)
        assert torch.allclose(torch.tensor(o.output_logprobs), ref, atol=1e-4)


def test_sampling_frequencies_follow_softmax(model):
    prompt = [1, 500, 600]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / 1.5, -1)
    n = 3000

    async def main():
        eng = EmbeddedEngine(model, seed=3, max_batch_size=256)
        outs = await asyncio.gather(
            *(eng.generate(prompt, {"max_new_tokens": 1, "temperature": 1.5}) for _ in range(n))
        )
        await eng.close()
        return outs

    counts = torch.zeros_like(probs)
    for o in run(main()):
        counts[o.output_ids[0]] += 1
    top = probs.topk(5).indices
    for t in top:  # each of the 5 likeliest tokens within 4 standard deviations
        p = probs[t].item()
        assert abs(counts[t].item() / n - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3


def test_seeded_requests_sample_the_same_tokens_in_any_batch(model):
    """``sampling_seed``: same seed -> same tokens, alone or among other requests, from fresh
    engines with different generator seeds; seeded frequencies still follow the softmax."""
    prompt = PROMPTS[3]
    params = {"max_new_tokens": 16, "temperature": 30.0, "ignore_eos": True}  # the tiny model is peaked

    async def alone(engine_seed, s):
        eng = EmbeddedEngine(model, seed=engine_seed)
        out = await eng.generate(prompt, {**params, "sampling_seed": s})
        await eng.close()
        return out.output_ids

    async def crowded(s):
        eng = EmbeddedEngine(model, seed=99, max_batch_size=8)
        others = [eng.generate(p, {**params, "max_new_tokens": 5 + i}) for i, p in enumerate(PROMPTS)]
        outs = await asyncio.gather(*others[:4], eng.generate(prompt, {**params, "sampling_seed": s}), *others[4:])
        await eng.close()
        return outs[4].output_ids

    a = run(alone(0, 12345))
    assert run(alone(7, 12345)) == a == run(crowded(12345))
    assert run(alone(0, 54321)) != a

    from rl2gem.rollout.engines.base import seeded_uniform

    us = [seeded_uniform(s, k) for s in range(200) for k in range(20)]
    assert all(0.0 <= u < 1.0 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.02
    assert len(set(us)) == len(us)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    async def main():
        eng = EmbeddedEngine(model)
        g = await eng.generate(PROMPTS[3], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        k = await eng.generate(PROMPTS[3], {"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "ignore_eos": True})
        p = await eng.generate(PROMPTS[3], {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1e-6, "ignore_eos": True})
        await eng.close()
        return g, k, p

    g, k, p = run(main())
    assert g.output_ids == k.output_ids == p.output_ids


def test_stop_tokens_lengths_and_bad_input(model):
    async def main():
        eng = EmbeddedEngine(model, context_length=64)
        free = await eng.generate(PROMPTS[0], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        stop_at = free.output_ids[2]
        stopped = await eng.generate(
            PROMPTS[0], {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at], "ignore_eos": True}
        )
        zero = await eng.generate(PROMPTS[0], {"max_new_tokens": 0})
        ctx = await eng.generate(list(range(10, 60)), {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True})
        errors = []
        for bad in ([], [1, 10**6], list(range(70))):
            try:
                await eng.generate(bad, {"max_new_tokens": 2})
            except ValueError as e:
                errors.append(str(e))
        try:
            await eng.generate([1, 2], {"max_new_tokenz": 2})
        except ValueError as e:
            errors.append(str(e))
        await eng.close()
        return free, stopped, zero, ctx, errors

    free, stopped, zero, ctx, errors = run(main())
    first = free.output_ids.index(free.output_ids[2])
    assert stopped.output_ids == free.output_ids[: first + 1]  # stop token kept in the output
    assert stopped.finish_reason == {"type": "stop", "matched": free.output_ids[2]}
    assert zero.output_ids == [] and zero.finish_reason["type"] == "length"
    assert 50 + len(ctx.output_ids) == 64 and ctx.finish_reason["type"] == "length"
    assert len(errors) == 4 and "max_new_tokens" in errors[-1]


def test_short_requests_do_not_wait_for_long_ones(model):
    """Continuous batching: a short request submitted with a long one returns first."""

    async def main():
        eng = EmbeddedEngine(model)
        order = []

        async def one(name, n):
            await eng.generate(PROMPTS[1], {"max_new_tokens": n, "ignore_eos": True})
            order.append(name)

        await asyncio.gather(one("long", 300), one("short", 5))
        await eng.close()
        return order

    assert run(main()) == ["short", "long"]


def test_pause_abort_returns_partial_tokens_and_queues_new_requests(model):
    async def main():
        eng = EmbeddedEngine(model)
        long = asyncio.ensure_future(eng.generate(PROMPTS[2], {"max_new_tokens": 1500, "ignore_eos": True}))
        while not eng.stats["decode_steps"]:
            await asyncio.sleep(0.005)
        await eng.pause()
        partial = await long
        queued = asyncio.ensure_future(eng.generate(PROMPTS[2], {"max_new_tokens": 3, "ignore_eos": True}))
        await asyncio.sleep(0.2)
        waited = not queued.done()
        await eng.resume()
        done = await queued
        await eng.close()
        return partial, waited, done

    partial, waited, done = run(main())
    assert partial.aborted and 0 < len(partial.output_ids) < 1500
    assert len(partial.output_logprobs) == len(partial.output_ids)
    assert waited and len(done.output_ids) == 3


def test_pause_in_place_keeps_requests(model):
    async def main():
        eng = EmbeddedEngine(model)
        t = asyncio.ensure_future(
            eng.generate(PROMPTS[2], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
        )
        while not eng.stats["decode_steps"]:
            await asyncio.sleep(0.005)
        await eng.pause("in_place")
        await asyncio.sleep(0.1)
        assert not t.done()
        await eng.resume()
        out = await t
        ref = await eng.generate(PROMPTS[2], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
        await eng.close()
        return out, ref

    out, ref = run(main())
    assert out.output_ids == ref.output_ids and not out.aborted


def test_abort_by_rid_and_cancellation(model):
    async def main():
        eng = EmbeddedEngine(model)
        a = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, rid="A"))
        b = asyncio.ensure_future(eng.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, rid="B"))
        while eng.load()["num_running_reqs"] < 2:
            await asyncio.sleep(0.005)
        await eng.abort("A")
        ra = await a
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        for _ in range(100):
            if eng.load()["num_running_reqs"] == 0:
                break
            await asyncio.sleep(0.01)
        load = eng.load()
        await eng.close()
        return ra, load

    ra, load = run(main())
    assert ra.aborted and ra.meta["id"] == "A"
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_weight_sync_engine_logprobs_equal_trainer(model):
    """After update_weights the engine scores a fixed sequence like the trainer's model (fp32, 1e-4)."""
    trainer = tiny_model(seed=0)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    seq = PROMPTS[5] + [700, 800, 900, 1000]
    loss = (
        -torch.log_softmax(trainer(torch.tensor([seq])).logits[0, :-1], -1)
        .gather(1, torch.tensor(seq[1:])[:, None])
        .mean()
    )
    loss.backward()
    opt.step()
    ref = teacher_logprobs(trainer, seq[:1], seq[1:])

    async def main():
        eng = EmbeddedEngine(model)
        before = await eng.generate(seq, {"max_new_tokens": 0}, logprob_start_len=1)
        version = await eng.update_weights(trainer.state_dict())
        after = await eng.generate(seq, {"max_new_tokens": 1}, logprob_start_len=1)
        with pytest.raises(KeyError):
            await eng.update_weights({"no.such.weight": torch.zeros(1)})
        # a wrong shape after a right one: refused whole (the first tensor was copied, the model mixed)
        first, last = list(trainer.state_dict().items())[0], list(trainer.state_dict().items())[-1]
        kept = {name: t.clone() for name, t in eng.model.state_dict().items()}
        with pytest.raises(ValueError, match="shape"):
            await eng.update_weights([(first[0], torch.zeros_like(first[1])), (last[0], torch.zeros(3))])
        assert all(torch.equal(t, kept[name]) for name, t in eng.model.state_dict().items())
        await eng.close()
        return before, after, version

    before, after, version = run(main())
    assert version == 1 and after.weight_version == 1 and before.weight_version == 0
    assert not torch.allclose(torch.tensor(before.input_logprobs), ref, atol=1e-3)
    assert torch.allclose(torch.tensor(after.input_logprobs), ref, atol=1e-4)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert SamplingParams.from_dict({"stop_token_ids": [3, 4]}).stop_token_ids == (3, 4)


def test_prefix_cache_serves_the_next_turn_with_identical_results(model):
    """A request extending a finished one (next turn) reuses its KV: same greedy tokens and logprobs."""
    first = PROMPTS[4]

    async def main(cache_tokens):
        eng = EmbeddedEngine(model, prefix_cache_tokens=cache_tokens)
        a = await eng.generate(first, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
        turn2 = first + a.output_ids + [900, 901, 902]
        # two concurrent requests: one extends the cached episode, one does not
        b, c = await asyncio.gather(
            eng.generate(turn2, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}),
            eng.generate(PROMPTS[7], {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}),
        )
        stats = dict(eng.stats)
        await eng.flush_cache()
        d = await eng.generate(turn2, {"max_new_tokens": 1, "temperature": 0})
        await eng.close()
        return turn2, b, c, stats, d

    turn2, b, c, stats, d = run(main(1 << 15))
    _, b0, c0, stats0, _ = run(main(0))
    assert b.meta["cached_tokens"] == len(PROMPTS[4]) + 9 and stats["cached_tokens"] >= b.meta["cached_tokens"]
    assert stats0["cached_tokens"] == 0 and d.meta["cached_tokens"] == 0
    assert b.output_ids == b0.output_ids and c.output_ids == c0.output_ids
    ref = teacher_logprobs(model, turn2, b.output_ids)
    assert torch.allclose(torch.tensor(b.output_logprobs), ref, atol=1e-4)
    greedy = model.generate(
        torch.tensor([turn2]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=2
    )
    assert b.output_ids == greedy[0, len(turn2) :].tolist()


def test_a_wave_finishing_together_dispatches_as_many_tensor_operations_for_8_rows_as_for_2(model):
    """The rows of a wave that end together go to the prefix cache in one copy per layer (on a GPU
    each operation is a kernel launch or more: one copy per row and layer was host time the device
    waited for), so finishing dispatches the same operations for 8 rows as for 2; every row's next
    turn is then served from the cache with the tokens of an engine without one."""
    params = {"max_new_tokens": 5, "temperature": 8.0, "ignore_eos": True, "sampling_seed": 3}  # reads every key

    async def main(rows, cache_tokens):
        prompts = [PROMPTS[i] + [500 + i] * 8 for i in range(rows)]
        eng = EmbeddedEngine(model, prefix_cache_tokens=cache_tokens)
        counts = []
        finish_rows, call_soon = eng._finish_rows, embedded._call_soon

        def counted(finished):  # on the engine thread, the only one that calls _call_soon
            wakeups = []
            embedded._call_soon = lambda *args: wakeups.append(args) or call_soon(*args)
            try:
                with OperationCounter() as ops:
                    finish_rows(finished)
            finally:
                embedded._call_soon = call_soon
            counts.append((len(finished), ops.count, len(wakeups)))

        eng._finish_rows = counted
        first = await admitted_together(eng, [eng.generate(p, params) for p in prompts])  # they finish together
        turns = [p + o.output_ids + [900] for p, o in zip(prompts, first, strict=True)]
        second = await asyncio.gather(*(eng.generate(t, params) for t in turns))
        await eng.close()
        for turn, out in zip(turns, second, strict=True):  # the next turn read the cached keys right
            expected = teacher_logprobs(model, turn, out.output_ids, 8.0)
            assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=1e-4)
        return counts[0], [o.output_ids for o in first + second], [o.meta["cached_tokens"] for o in second], turns

    operations = {}
    for rows in (2, 8):
        (finished, operations[rows], wakeups), tokens, cached, turns = run(main(rows, 1 << 15))
        _, plain_tokens, _, _ = run(main(rows, 0))
        assert finished == rows and tokens == plain_tokens
        assert wakeups == 1  # the requester's event loop is woken once for the wave, not once per row
        assert cached == [len(turn) - 2 for turn in turns]  # every prefix but the last two tokens
    assert operations[2] == operations[8], operations


def test_streams_get_a_round_s_tokens_in_one_wake_up_of_their_loop(model, monkeypatch):
    """Four requests streamed at once, four decode steps per round: each round's tokens reach the
    event loop in one call (one wake-up per token and row before, 16 per round), as the rounds
    go (more calls than one), every token once, in order, before the answer that repeats them."""
    calls, call_soon = [], embedded._call_soon
    monkeypatch.setattr(embedded, "_call_soon", lambda *args: calls.append(args[1]) or call_soon(*args))
    params = {"max_new_tokens": 13, "temperature": 8.0, "ignore_eos": True}

    async def consume(stream):
        return [item async for item in stream]

    async def main():
        eng = EmbeddedEngine(model, decode_graphs=True, decode_steps=4)
        streams = await admitted_together(eng, [consume(eng.generate_stream(PROMPTS[i], params)) for i in range(4)])
        stats = await eng.settled_stats()
        await eng.close()
        return streams, stats

    streams, stats = run(main())
    for prompt, items in zip(PROMPTS, streams, strict=False):
        out = items[-1]
        assert [token for token, _ in items[:-1]] == out.output_ids and len(out.output_ids) == 13
        assert [logprob for _, logprob in items[:-1]] == out.output_logprobs
        assert torch.allclose(
            torch.tensor(out.output_logprobs), teacher_logprobs(model, prompt, out.output_ids, 8.0), atol=1e-4
        )
    stream_calls = sum(callback is embedded._stream_all for callback in calls)
    # the prefill's first tokens, then 12 tokens in rounds of 4 steps
    assert stats["decode_rounds"] == 3 and stream_calls == 1 + stats["decode_rounds"], (stream_calls, stats)


def test_the_prefix_cache_keeps_the_newest_turns_within_its_budget(model):
    """A budget that holds about two finished episodes: the next turn of the newest is served
    from the cache, that of the oldest prefills again; tokens equal an engine without a cache."""
    params = {"max_new_tokens": 6, "temperature": 8.0, "ignore_eos": True, "sampling_seed": 5}
    prompts = [PROMPTS[9] + [600 + i] * 10 for i in range(3)]  # 20 tokens each, 26 with the answer

    async def main(cache_tokens):
        eng = EmbeddedEngine(model, prefix_cache_tokens=cache_tokens)
        first = [await eng.generate(p, params) for p in prompts]  # one after the other
        turns = [p + o.output_ids + [901] for p, o in zip(prompts, first, strict=True)]
        newest = await eng.generate(turns[2], params)
        oldest = await eng.generate(turns[0], params)
        await eng.close()
        for turn, out in ((turns[2], newest), (turns[0], oldest)):
            expected = teacher_logprobs(model, turn, out.output_ids, 8.0)
            assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=1e-4)
        return newest, oldest

    newest, oldest = run(main(60))
    plain_newest, plain_oldest = run(main(0))
    assert newest.meta["cached_tokens"] == 26 and oldest.meta["cached_tokens"] < 26
    assert newest.output_ids == plain_newest.output_ids and oldest.output_ids == plain_oldest.output_ids


def test_a_prompt_extending_a_running_row_s_prompt_reads_that_row_s_keys(model, monkeypatch):
    """A request whose prompt extends that of a row still decoding (a GRPO group's later request)
    takes its prefix from the running row's columns, after that row moved to another slot, in the
    same prefill as a request served from the prefix cache (the two sources gathered apart):
    both requests' sampled log-probs equal teacher forcing."""
    from rl2gem.rollout.engines.embedded import _KVStore

    moves, move = [], _KVStore.move
    monkeypatch.setattr(_KVStore, "move", lambda self, *rows: moves.append(rows) or move(self, *rows))
    params = {"max_new_tokens": 6, "temperature": 8.0, "ignore_eos": True, "sampling_seed": 7}
    shared = PROMPTS[9] + [700] * 6  # 15 tokens
    first_prompt = PROMPTS[8] + [800] * 20  # the longer prompt: the first slot, its row finishes first

    async def main():
        eng = EmbeddedEngine(model)
        finish_rows = eng._finish_rows

        def finish_then_pause(finished):  # on the engine thread: the long row waits after the short one
            finish_rows(finished)
            eng._paused = eng._paused or any(r.input_ids == first_prompt for r, _ in finished)

        eng._finish_rows = finish_then_pause
        await eng.pause("in_place")  # both admitted in one prefill: the short one in the first slot
        short = asyncio.ensure_future(eng.generate(first_prompt, {**params, "max_new_tokens": 2}))
        long = asyncio.ensure_future(eng.generate(shared, {**params, "max_new_tokens": 60}))
        while len(eng._waiting) < 2:
            await asyncio.sleep(0.005)
        await eng.resume()
        first = await short  # its slot freed: the long row moved into it, its KV in the cache
        # two new tokens after the running row's prompt; one after the cached sequence: the rows
        # with more new tokens come first, so the running row's prefix precedes the cached one
        requests = [shared + [701, 702], first_prompt + first.output_ids]
        tasks = [asyncio.ensure_future(eng.generate(r, params)) for r in requests]
        while len(eng._waiting) < 2:
            await asyncio.sleep(0.005)
        await eng.resume()  # both admitted in one prefill, the long row still running
        outs = await asyncio.gather(*tasks)
        await long
        await eng.close()
        return requests, outs

    requests, outs = run(main())
    assert moves == [([1], [0])]  # the long row moved before the two prompts were admitted
    assert [o.meta["cached_tokens"] for o in outs] == [len(shared), len(requests[1]) - 1]
    for request, out in zip(requests, outs, strict=True):
        expected = teacher_logprobs(model, request, out.output_ids, 8.0)
        assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=1e-4)


def test_a_groups_identical_prompts_are_prefilled_once(model):
    async def main():
        eng = EmbeddedEngine(model, seed=4)
        params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 8.0}
        outs = await asyncio.gather(*(eng.generate(PROMPTS[9], params) for _ in range(4)))
        stats = dict(eng.stats)
        await eng.close()
        return outs, stats

    outs, stats = run(main())
    n = len(PROMPTS[9])
    # prefilled once (plus at most its last token again, when the first request was admitted alone)
    assert stats["prefill_tokens"] <= n + 1 and stats["prefill_tokens"] + stats["cached_tokens"] == 4 * n
    assert len({tuple(o.output_ids) for o in outs}) > 1  # still independent samples
    for o in outs:
        assert torch.allclose(
            torch.tensor(o.output_logprobs), teacher_logprobs(model, PROMPTS[9], o.output_ids, 8.0), atol=1e-4
        )


def test_a_prefix_shared_by_different_prompts_is_prefilled_once(model):
    """Prompts admitted together that share a system prompt (but differ after it) prefill the shared
    part once; their tokens and log-probs equal those of an engine without a prefix cache."""
    system = list(range(500, 512))  # 12 shared tokens
    prompts = [system + [600 + i] * (1 + i % 3) for i in range(6)]

    async def main(cache_tokens):
        eng = EmbeddedEngine(model, prefix_cache_tokens=cache_tokens)
        # seeded at temperature 8: the tokens and log-probs read every cached key (greedy tokens
        # of this model would not notice wrong ones)
        params = [{"max_new_tokens": 8, "ignore_eos": True, "temperature": 8.0, "sampling_seed": i} for i in range(6)]
        outs = await admitted_together(eng, [eng.generate(p, q) for p, q in zip(prompts, params, strict=True)])
        stats = dict(eng.stats)
        await eng.close()
        return outs, stats

    outs, stats = run(main(1 << 15))
    plain, plain_stats = run(main(0))
    total = sum(map(len, prompts))
    assert plain_stats["prefill_tokens"] == total and plain_stats["cached_tokens"] == 0
    # the 12 shared tokens once, then each prompt's own tail
    assert stats["prefill_forwards"] == 2 and stats["prefill_tokens"] == len(system) + total - len(prompts) * len(
        system
    )
    assert stats["cached_tokens"] == len(prompts) * len(system)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    for o, p in zip(outs, prompts, strict=True):
        expected = teacher_logprobs(model, p, o.output_ids, 8.0)
        assert torch.allclose(torch.tensor(o.output_logprobs), expected, atol=1e-4)


def test_state_dict_restores_unseeded_sampling(model):
    """The engine's public state (its sampler RNG) taken between requests and restored makes the
    next unseeded samples repeat; without restoring they differ."""

    async def sample(eng):
        out = await eng.generate([1, 5, 9], {"max_new_tokens": 12, "temperature": 100.0, "ignore_eos": True})
        return out.output_ids

    async def main():
        eng = EmbeddedEngine(model, seed=3)
        try:
            state = eng.state_dict()
            first = await sample(eng)
            second = await sample(eng)
            eng.load_state_dict(state)
            again = await sample(eng)
        finally:
            await eng.close()
        return first, second, again

    first, second, again = run(main())
    assert again == first and second != first


def test_release_memory_frees_the_kv_buffers_and_the_engine_serves_the_same_after(model):
    """Between a trainer's rollout and its update the engine gives its KV buffers and prefix cache
    back; the next request allocates again and decodes exactly as before. A running request keeps
    them."""
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def main():
        eng = EmbeddedEngine(model)
        a = await eng.generate(PROMPTS[2], greedy)
        held = (eng._store.capacity, eng._prefill_store.capacity, eng._prefix_cache.size)
        await eng.release_memory()
        freed = (eng._store.capacity, eng._prefill_store.capacity, eng._prefix_cache.size, eng._store.keys)
        freed += (eng._prefix_cache.capacity,)  # the pool of cached prefixes too
        b = await eng.generate(PROMPTS[2], greedy)
        long = asyncio.ensure_future(eng.generate(PROMPTS[3], {**greedy, "max_new_tokens": 200}))
        while not eng._running:
            await asyncio.sleep(0.01)
        await eng.release_memory()
        kept = eng._store.capacity
        c = await long
        await eng.close()
        return a, b, c, held, freed, kept

    a, b, c, held, freed, kept = run(main())
    assert held[0][0] > 0 and held[0][1] > 0 and held[1][1] > 0 and held[2] > 0
    assert freed == ((0, 0), (0, 0), 0, [], 0)
    assert b.output_ids == a.output_ids and b.output_logprobs == a.output_logprobs
    assert kept[0] > 0 and len(c.output_ids) == 200


def test_prompt_logprobs_of_a_prompt_longer_than_one_chunk(model):
    """A 1,500-token prompt's log-probs (log-softmax in chunks of 1,024 positions) at temperature
    0.7 from position 3 on: the teacher-forced reference's, the first ones ``None``-free."""
    prompt = [(17 * i) % 900 + 3 for i in range(1500)]

    async def main():
        eng = EmbeddedEngine(model)
        out = await eng.generate(prompt, {"max_new_tokens": 0, "temperature": 0.7}, logprob_start_len=3)
        await eng.close()
        return out

    out = run(main())
    expected = teacher_logprobs(model, prompt[:3], prompt[3:], temperature=0.7)
    assert len(out.input_logprobs) == 1497
    torch.testing.assert_close(torch.tensor(out.input_logprobs), expected, atol=1e-5, rtol=1e-5)


def test_an_error_in_the_prompt_logprobs_fails_the_admitted_requests(model):
    """Out of memory while computing a prompt's log-probs (the whole prompt's logits at once), after
    the request left the queue: it and the request admitted with it end with the engine error
    (before, neither was answered, ever); the next request decodes as on an engine that never
    failed."""
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def main():
        eng = EmbeddedEngine(model)
        reference = await eng.generate(PROMPTS[2], greedy)
        original = eng._input_logprobs

        def failing(request):
            raise RuntimeError("out of memory")

        eng._input_logprobs = failing
        await eng.pause()
        both = asyncio.gather(eng.generate(PROMPTS[3], greedy, logprob_start_len=0), eng.generate(PROMPTS[4], greedy))
        while len(eng._waiting) < 2:
            await asyncio.sleep(0.01)
        await eng.resume()  # both are admitted in one wave
        failed = await asyncio.wait_for(both, 60)
        eng._input_logprobs = original
        after = await eng.generate(PROMPTS[2], greedy)
        await eng.close()
        return reference, failed, after

    reference, failed, after = run(main())
    for output in failed:
        assert output.aborted and "engine error: RuntimeError: out of memory" in output.finish_reason["message"]
    assert after.output_ids == reference.output_ids and after.output_logprobs == reference.output_logprobs


@pytest.mark.parametrize("failing_call", [1, 3], ids=["prefill", "decode"])
def test_an_allocation_failure_fails_the_requests_and_the_next_ones_decode_as_before(model, failing_call):
    """Out of memory half-way through growing the KV buffers (one layer already re-allocated, the
    next fails), while a request is prefilled or while it decodes: the request ends with the
    engine error (it does not wait forever), and the engine serves the next requests exactly as
    an engine that never failed."""
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def main():
        eng = EmbeddedEngine(model)
        reference = await eng.generate(PROMPTS[2], greedy)
        store, original = eng._store, eng._store.reserve
        calls = []

        def failing_reserve(slots, left, right, growth=0, expect=0):
            calls.append(slots)
            if len(calls) < failing_call:
                return original(slots, left, right, growth, expect)
            store.pairs[0] = torch.zeros(2, 1, 1, 1, 1)  # the first layer re-allocated, then memory runs out
            raise RuntimeError("out of memory")

        store.reserve = failing_reserve
        failed = await eng.generate(PROMPTS[2], greedy)
        store.reserve = original
        after = await eng.generate(PROMPTS[2], greedy)
        await eng.close()
        return reference, failed, after

    reference, failed, after = run(main())
    assert failed.aborted and "engine error: RuntimeError: out of memory" in failed.finish_reason["message"]
    assert len(failed.output_ids) == (0 if failing_call == 1 else failing_call - 1)
    assert after.output_ids == reference.output_ids and after.output_logprobs == reference.output_logprobs


def test_engine_times_add_up_rounds_shorter_than_a_millisecond(model, monkeypatch):
    """``time_*_ms`` sum each round's time unrounded: on a clock that advances 0.3 ms per reading
    (every round shorter than a millisecond), the decode time is the readings' spans, not 0 (it
    was rounded down per round, which made fast rounds look free)."""
    import rl2gem.rollout.engines.embedded as embedded

    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 3e-4
            return self.now

        def __getattr__(self, name):
            return getattr(time, name)

    async def main():
        eng = EmbeddedEngine(model, max_batch_size=2)
        await eng.generate(PROMPTS[0], {"max_new_tokens": 1, "temperature": 0})  # warm
        monkeypatch.setattr(embedded, "time", Clock())
        before = dict(eng.stats)
        await eng.generate(PROMPTS[1], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        after = dict(eng.stats)
        monkeypatch.undo()
        await eng.close()
        return before, after

    before, after = run(main())
    rounds = after["decode_rounds"] - before.get("decode_rounds", 0)
    decode_ms = after["time_decode_ms"] - before.get("time_decode_ms", 0)
    assert rounds == 7
    # each round reads the clock at least twice around _decode: at least one 0.3 ms span each
    assert decode_ms >= rounds * 0.3 - 1e-9


def test_settled_stats_hold_the_last_round_s_times(model):
    """An answer arrives inside its last round: ``stats`` read then may lack that round's decode
    time; :meth:`settled_stats`, read between rounds, has every round's, so the decode time is at
    least the step time within it."""

    async def main():
        eng = EmbeddedEngine(model, max_batch_size=2)
        await eng.generate(PROMPTS[2], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        stats = await eng.settled_stats()
        await eng.close()
        return stats

    stats = run(main())
    assert stats["decode_rounds"] == 5
    assert stats["time_decode_ms"] >= stats["time_decode_forward_ms"] + stats["time_decode_handout_ms"]
    assert stats["time_decode_forward_ms"] > 0 and stats["time_decode_handout_ms"] > 0


def test_rows_finishing_in_one_round_move_each_row_that_goes_on_at_most_once(model, monkeypatch):
    """Six of eight rows finish in the same decode round (5 tokens), two go on (9): each of those
    two moves at most once, from a slot past the two kept into a freed one, both in one copy (one
    finish at a time moved a row once per finish below it: five moves here), and every row's tokens, its next
    turn's cached prefix and that turn's tokens are what they would be alone."""
    from rl2gem.rollout.engines.embedded import _KVStore

    moves, calls = [], []
    original = _KVStore.move

    def move(self, sources, destinations):
        calls.append(len(sources))
        moves.extend(zip(sources, destinations, strict=True))
        original(self, sources, destinations)

    monkeypatch.setattr(_KVStore, "move", move)
    prompts = [list(range(10, 10 + 6 + i)) for i in range(8)]
    budgets = [5, 9, 5, 5, 9, 5, 5, 5]
    greedy = {"temperature": 0, "ignore_eos": True}

    async def main():
        eng = EmbeddedEngine(model, max_batch_size=8)
        # all eight admitted at once: six finish in one round
        requests = [eng.generate(p, {**greedy, "max_new_tokens": n}) for p, n in zip(prompts, budgets, strict=True)]
        outs = await admitted_together(eng, requests)
        turns = [
            await eng.generate(p + o.output_ids + [7], {**greedy, "max_new_tokens": 2})
            for p, o in zip(prompts, outs, strict=True)
        ]
        await eng.close()
        return outs, turns

    outs, turns = run(main())
    assert 0 < len(moves) <= 2 and len({src for src, _ in moves}) == len(moves)  # the single turns move nothing
    assert len(calls) == 1  # the rows that go on move in one indexed copy per layer
    assert all(dst < 2 <= src for src, dst in moves)
    for p, o, n, t in zip(prompts, outs, budgets, turns, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert o.output_ids == ref[0, len(p) :].tolist()
        turn = p + o.output_ids + [7]
        # the finished row's KV, all but its last sampled token (never written)
        assert t.meta["cached_tokens"] == len(p) + n - 1
        ref = model.generate(torch.tensor([turn]), max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert t.output_ids == ref[0, len(turn) :].tolist()


@pytest.mark.parametrize("limit", ["max_prefill_tokens", "max_cached_tokens"])
def test_admission_keeps_to_the_prefill_and_cached_token_limits(model, limit):
    """Six 20-token prompts admitted together: ``max_prefill_tokens=45`` prefills two per forward
    (three would be 60 tokens); ``max_cached_tokens=70`` keeps at most three rows (three rows of
    the 20-column window and its next column are 63 tokens, four are 84). Greedy tokens equal the
    unlimited engine's."""
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    prompts = [list(range(10 + 7 * i, 30 + 7 * i)) for i in range(6)]

    async def main(options):
        eng = EmbeddedEngine(model, max_batch_size=8, **options)
        prefill, most = eng._prefill, []

        def counting(take, **options):
            most.append(len(eng._running) + len(take))
            return prefill(take, **options)

        eng._prefill = counting
        outs = await admitted_together(eng, [eng.generate(p, greedy) for p in prompts])
        stats = await eng.settled_stats()
        await eng.close()
        return [o.output_ids for o in outs], stats["prefill_forwards"], max(most)

    limited, forwards, rows = run(main({limit: 45 if limit == "max_prefill_tokens" else 70}))
    free, free_forwards, free_rows = run(main({}))
    assert limited == free and free_forwards == 1 and free_rows == 6
    if limit == "max_prefill_tokens":
        assert forwards == 3
    else:
        assert rows == 3 and forwards >= 2
