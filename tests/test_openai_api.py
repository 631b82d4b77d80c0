"""The OpenAI-compatible API of rl2gem.serve, used through the real ``openai`` client, and
``rl2gem.evaluate`` against served models (live servers on 127.0.0.1 only)."""

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import tokenizers
import torch
from helpers import serving
from tiny import tiny_model
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rl2gem.evaluate import parse_args
from rl2gem.evaluation import evaluate
from rl2gem.rollout.engines.base import Engine, GenerateOutput
from rl2gem.rollout.tito import ChatRenderer, load_chat_template
from rl2gem.serving import launch, make_app
from rl2gem.serving.openai_routes import IncrementalText, openai_tool_calls, template_messages
from rl2gem.tools import parse_tool_calls
from rl2gem.tools.base import hermes_tool_calls

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CALL = 'Let me compute it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
ANSWER = "The product is \\boxed{42}."


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = launch(str(tiny_dir), threads=1, served_model_name="tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)


def greedy_ids(prompt: list[int], n: int) -> list[int]:
    """The tiny model's greedy continuation by transformers' generate (the reference)."""
    out = tiny_model().generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=2
    )
    ids = out[0, len(prompt) :].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids


# ----------------------------------------------------------------------------- conversions
def test_tool_calls_convert_both_ways():
    content, calls = openai_tool_calls(CALL)
    assert content == "Let me compute it."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "python", {"code": "print(6 * 7)"})
    ]
    text = hermes_tool_calls(calls)
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(text)] == [
        ("python", {"code": "print(6 * 7)"}, None)
    ]
    assert openai_tool_calls("no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert openai_tool_calls(broken) == (broken, [])  # the client sees what the model wrote


def test_template_messages_render_tool_turns_as_the_model_wrote_them():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "6*7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(6*7)"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    out = template_messages(messages)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[2] == {"role": "assistant", "content": hermes_tool_calls(messages[2]["tool_calls"])}
    assert out[3] == {"role": "tool", "content": "42"}
    native = template_messages(messages, template_reads_tool_calls=True)[2]
    assert native["tool_calls"] == [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}
    ]
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(ValueError):
            template_messages(bad)


def test_incremental_text_equals_decoding_every_token_again(tokenizer):
    """A reply's text kept up to date token by token (what a stream sends) equals decoding all its
    tokens at every step, through multi-byte characters split over tokens (None until complete,
    as the whole decode then ends in U+FFFD), leading spaces, special tokens and random ids; and
    each update decodes a bounded number of tokens, not the whole reply."""
    rng = random.Random(0)
    text = "Héllo wörld, 世界 🎉🎉 naïve café\n  indented\tcode: x = [1, 2]  " * 3
    replies = [tokenizer.encode(text, add_special_tokens=False)]
    replies.append(tokenizer.encode("a" + tokenizer.eos_token + " b 🎉 c", add_special_tokens=False))
    replies += [[rng.randrange(tokenizer.vocab_size) for _ in range(150)] for _ in range(4)]
    decoded = []

    class Counted:  # a tokenizer, counting the tokens each decode reads; optionally cleaning up spaces
        def __init__(self, tokenizer, **options):
            self.tokenizer, self.options = tokenizer, options

        def decode(self, tokens, **kwargs):
            decoded.append(len(tokens))
            return self.tokenizer.decode(tokens, **kwargs, **self.options)

    def check(counted, ids):
        incremental = IncrementalText(counted)
        for end in range(1, len(ids) + 1):
            whole = counted.tokenizer.decode(ids[:end], skip_special_tokens=True, **counted.options)
            got = incremental.update(ids[:end])
            assert got == (None if whole.endswith("\ufffd") else whole), (ids[:end], got, whole)

    for ids in replies:
        check(Counted(tokenizer), ids)
        assert max(decoded) < 16, decoded  # a few tokens of context and the new ones, never the whole
        decoded.clear()
    # spaces cleaned up before punctuation and contractions (transformers 4's default for many
    # tokenizers): patterns of three or four tokens across an update's start
    pieces = [tokenizer.encode(p, add_special_tokens=False) for p in (" do", " n't", " x", " '", "s", " .", " ,", "!")]
    pieces += [[tokenizer.eos_token_id], tokenizer.encode(" 's", add_special_tokens=False)]
    for _ in range(30):
        check(Counted(tokenizer, clean_up_tokenization_spaces=True), [t for _ in range(25) for t in rng.choice(pieces)])
    # a SentencePiece decoder drops the space of the first word it decodes, also after a special token
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁it": 6, "'s": 7, ".": 8, "▁": 9}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer, model.decoder = tokenizers.pre_tokenizers.Metaspace(), tokenizers.decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    check(Counted(metaspace), [3, 2, 4, 5])  # "Hello world!", not "Helloworld!"
    check(Counted(metaspace), [3] + [2] * 8 + [4, 5])  # a context of special tokens only
    for _ in range(30):
        check(Counted(metaspace, clean_up_tokenization_spaces=True), [rng.randrange(1, 10) for _ in range(40)])
    # Llama 2's and Mistral's decoder: "▁" as a space, byte tokens fused into UTF-8, the first space
    # stripped; a character split over byte tokens, after a word or a special token
    words = ["▁Hello", "▁world", "!", "▁it", "'s", ".", "▁", "▁数", "学"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    model = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    model.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    fallback = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    pieces = [[vocab[w]] for w in words] + [[vocab[f"<0x{b:02X}>"] for b in c.encode()] for c in "é数🙂"] + [[2]]
    assert fallback.decode(pieces[0] + pieces[10] + pieces[1]) == "Hello数 world"
    for _ in range(60):
        check(Counted(fallback), [t for _ in range(rng.randrange(1, 30)) for t in rng.choice(pieces)])


# ----------------------------------------------------------------------------- live embedded server
def test_models_and_a_greedy_chat_completion_equal_the_model(client, tokenizer):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True)
    prompt = ChatRenderer(tokenizer).prompt_ids(QUESTION)
    expected = greedy_ids(prompt, 8)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == 2 else "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(expected)
    assert len(choice.logprobs.content) == len(expected) and all(t.logprob <= 0 for t in choice.logprobs.content)


def test_a_streamed_reply_arrives_in_pieces_and_equals_the_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2  # token by token, not one block at the end
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_follow_the_model_and_cut_at_stop_strings(client, tokenizer):
    prompt = "The capital of France is"
    expected = greedy_ids(tokenizer.encode(prompt, add_special_tokens=False), 6)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].text == text and len(reply.choices[0].logprobs.token_logprobs) == len(expected)
    stop = text[len(text) // 2 :][:3]
    if stop.strip():
        cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    ids = client.completions.create(model="tiny", prompt=[[1, 1000, 2000]], max_tokens=3, temperature=1.0, n=2, seed=7)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.completion_tokens <= 6


def test_requests_it_cannot_serve_get_400_with_a_reason(client):
    cases = [
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"tools": [PYTHON_TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [PYTHON_TOOL]}, "--chat-template"),  # SmolLM2's own template has no tools
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 10**9}, "max_tokens asks for 1000000000 more"),  # refused as vLLM does, not cut short
        ({"max_completion_tokens": 10**6}, "at most"),
    ]
    for extra, reason in cases:
        kwargs = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError, match=reason.replace("-", r"\-")):
            client.chat.completions.create(**kwargs)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="model_not_found"):  # as OpenAI answers an unknown model
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve("tiny").id == "tiny"


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"max_tokens": 1e400}, "max_tokens must be an integer, got inf"),  # valid JSON: it gave a 500
        ({"temperature": 10**400}, "temperature is out of range"),
        ({"seed": 1e400}, "seed must be an integer"),
        ({"stream": "false"}, "stream must be true or false"),  # a string streamed
        ({"logprobs": "yes"}, "logprobs must be true or false"),
        ({"stream_options": {"include_usage": True}}, "only allowed with stream=true"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions="),
        ({"tools": [{"type": "function"}]}, "tools[0] must be {'type': 'function', 'function': {...}}"),  # was a 200
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name must be"),
        ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters must be"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}]},
            "a tool call's function must be an object",  # a 500 (AttributeError) before
        ),
    ],
)
def test_malformed_chat_requests_are_400s(server, extra, reason):
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, **extra}
    raw = json.dumps(body).replace("Infinity", "1e400").encode()  # json writes inf as Infinity
    request = urllib.request.Request(server.url + "/v1/chat/completions", raw, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    answer = json.loads(error.value.read())
    assert error.value.code == 400 and reason in answer["error"]["message"], answer


def test_completion_prompts_of_token_ids_hold_integers(server):
    status, answer = _post(server.url + "/v1/completions", {"model": "tiny", "prompt": [[1, 2.7]], "max_tokens": 2})
    assert status == 400 and "integers only" in answer["error"]["message"]  # 2.7 was read as 2


def test_max_completion_tokens_null_falls_back_to_max_tokens(client):
    """The openai client sends null for an explicit None: max_tokens was ignored then (the reply ran
    to the end of the context)."""
    reply = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=3, max_completion_tokens=None, temperature=1.0, seed=1
    )
    assert reply.usage.completion_tokens <= 3


def test_a_stream_the_engine_refuses_at_once_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        list(client.completions.create(model="tiny", prompt=[[99999999]], max_tokens=2, stream=True))


def test_streamed_text_offsets_count_from_the_start_of_the_text(client):
    kwargs = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 0}
    whole = client.completions.create(**kwargs).choices[0].logprobs.text_offset
    chunks = client.completions.create(**kwargs, stream=True)
    streamed = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole and len(whole) == 8


def test_the_api_in_front_of_another_server_answers_the_same(server, client, tiny_dir):
    front = launch(str(tiny_dir), threads=1, served_model_name="tiny", upstream=server.url)
    try:
        via = openai.OpenAI(base_url=front.url + "/v1", api_key="EMPTY", max_retries=0)
        direct = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, temperature=0)
        proxied = via.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, temperature=0)
        assert proxied.choices[0].message.content == direct.choices[0].message.content
        streamed = via.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == direct.choices[0].message.content
        # the front knows the upstream's context (2048, from /get_server_info), not a default 4096
        with pytest.raises(openai.BadRequestError, match="this model's context is 2048 tokens"):
            via.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3000)
    finally:
        front.stop()


# ----------------------------------------------------------------------------- tool calls, scripted model
class ScriptedEngine(Engine):
    """Writes a python tool call, then (once the prompt holds a tool response) a boxed answer;
    records each prompt it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []
        self.reply: str | None = None  # a test's own reply, else the call then the answer

    async def generate(self, input_ids, sampling_params=None, *, return_logprob=True, logprob_start_len=-1, rid=None):
        prompt = self.tokenizer.decode(input_ids)
        self.prompts.append(prompt)
        reply = self.reply or (ANSWER if "<tool_response>" in prompt else CALL)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]
        return GenerateOutput(ids, [-0.5] * len(ids), {"type": "stop"}, len(input_ids))

    async def pause(self, mode="abort"):
        pass

    async def resume(self):
        pass

    async def abort(self, rid=None):
        pass

    async def update_weights(self, weights, version=None):
        return 0

    async def health(self):
        return True


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer)
    app = make_app(
        engine,
        tokenizer=tokenizer,
        served_model_name="scripted",
        chat_template=load_chat_template("chatml_tools"),
        native=False,
    )
    with serving(app) as url:
        yield engine, url


def test_a_tool_call_round_trip_with_the_openai_client(scripted):
    engine, url = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    messages = list(QUESTION)
    first = client.chat.completions.create(model="scripted", messages=messages, tools=[PYTHON_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute it."
    (call,) = choice.message.tool_calls
    assert call.function.name == "python" and json.loads(call.function.arguments) == {"code": "print(6 * 7)"}
    assert json.dumps(PYTHON_TOOL) in engine.prompts[-1]  # the template rendered the schema
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = client.chat.completions.create(model="scripted", messages=messages, tools=[PYTHON_TOOL])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == ANSWER
    prompt = engine.prompts[-1]  # the call went back as the model wrote it, the result as a tool response
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>' in prompt
    assert "<tool_response>\n42\n</tool_response>" in prompt

    stream = list(client.chat.completions.create(model="scripted", messages=QUESTION, tools=[PYTHON_TOOL], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert "<tool_call" not in text and text.strip() == "Let me compute it."
    calls = [t for c in stream for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "python", {"code": "print(6 * 7)"})
    ]
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # a stop string after the call: the call is still held back from the content, and sent as a call
    stream = list(
        client.chat.completions.create(
            model="scripted", messages=QUESTION, tools=[PYTHON_TOOL], stream=True, stop=["</tool_call>"]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert "<tool_call" not in text and text.strip() == "Let me compute it."


@pytest.mark.parametrize(
    "reply",
    [
        '\n\nA <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call> Bcdef',
        'Sure.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\nDone now.  ',
        "\n  Hello there.  \n",  # no call
        "Hi <tool_call>not json</tool_call> after",  # a malformed call: text, not a call
    ],
)
def test_a_streamed_tool_call_reply_has_the_whole_replys_content(scripted, reply):
    """The prose around a call, streamed, is what the whole reply's content is (stripped at both
    ends, the call removed): a reply opening with white space lost the character after the call."""
    engine, url = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    engine.reply = reply
    try:
        whole = client.chat.completions.create(model="scripted", messages=QUESTION, tools=[PYTHON_TOOL])
        stream = list(
            client.chat.completions.create(model="scripted", messages=QUESTION, tools=[PYTHON_TOOL], stream=True)
        )
    finally:
        engine.reply = None
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    content = whole.choices[0].message.content
    if "not json" in reply or "<tool_call>" not in reply:  # no (valid) call: the text, stripped
        assert streamed == content == reply.strip() and not whole.choices[0].message.tool_calls
        return
    before, after = reply.split("<tool_call>")[0], reply.split("</tool_call>")[1]
    assert streamed == content == (before + after).strip()


def test_log_prob_bytes_of_a_character_split_over_tokens_join_to_its_utf8(scripted):
    engine, url = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    engine.reply = "\U0001f389"  # three byte-level tokens
    try:
        reply = client.chat.completions.create(model="scripted", messages=QUESTION, logprobs=True)
    finally:
        engine.reply = None
    entries = reply.choices[0].logprobs.content[:-1]  # the end-of-turn token last
    assert len(entries) == 3 and b"".join(bytes(e.bytes) for e in entries) == "\U0001f389".encode()


def test_a_chat_template_that_refuses_the_conversation_gives_a_400(tokenizer):
    strict = (
        "{%- for m in messages -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{%- endif -%}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}<|im_start|>assistant\n"
    )
    app = make_app(
        ScriptedEngine(tokenizer), tokenizer=tokenizer, served_model_name="s", chat_template=strict, native=False
    )
    with serving(app) as url:
        body = {"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "2+2?"}]}
        status, answer = _post(url + "/v1/chat/completions", body)
    assert status == 400 and "roles must alternate" in answer["error"]["message"]  # a 500 before


def test_evaluate_plays_a_tool_env_through_the_openai_api(scripted, tmp_path):
    """The python tool really ran on this host: its printed 42 reached the model's next prompt."""
    engine, url = scripted
    cfg = parse_args(
        [
            "env=rl2/PythonMath-v0",
            f"openai_base_url={url}/v1",
            "openai_model=scripted",
            "n=2",
            "progress=false",
            f"output={tmp_path}/e.jsonl",
        ]
    )
    records = evaluate(cfg)
    assert len(records) == 2
    for r in records:
        assert r.final_info["num_tool_calls"] == 1 and r.turns == 2
        assert [m["role"] for m in r.messages] == ["user", "assistant", "tool", "assistant"]
        assert r.messages[1]["content"].endswith("</tool_call>") and r.messages[2]["content"].strip() == "42"
        assert r.final_info["answer"] == "42" and r.messages[3]["content"] == ANSWER
    assert sum("<tool_response>\n42" in p for p in engine.prompts) >= 2
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- evaluate and the example
def test_evaluate_through_a_server_equals_local_evaluation(server, tiny_dir, tmp_path):
    common = ["env=rl2/GuessTheNumber-v0", "n=3", "max_new_tokens=12", "progress=false"]
    local = evaluate(parse_args([*common, f"model={tiny_dir}", f"output={tmp_path}/local.jsonl"]))
    served = evaluate(parse_args([*common, f"server={server.url}", f"output={tmp_path}/served.jsonl"]))
    api = evaluate(
        parse_args([*common, f"openai_base_url={server.url}/v1", "openai_model=tiny", f"output={tmp_path}/api.jsonl"])
    )
    assert [(r.seed, r.index) for r in api] == [(r.seed, r.index) for r in served] == [(r.seed, r.index) for r in local]
    assert [r.messages for r in served] == [r.messages for r in local]  # token in, token out: the same episodes
    assert [r.generated_tokens for r in served] == [r.generated_tokens for r in local]
    assert [r.reward for r in served] == [r.reward for r in local]
    # the API re-renders text each turn; its first turn sees the same prompt, so it answers the same
    assert [r.messages[:2] for r in api] == [r.messages[:2] for r in local]


def test_the_openai_client_example_runs_against_a_local_server(server):
    r = subprocess.run(
        [sys.executable, "examples/eval_with_openai_client.py", "--base-url", server.url + "/v1"]
        + ["--env", "rl2/GuessTheNumber-v0", "--episodes", "2", "--max-tokens", "8"],  # no split: none passed
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["episode 0", "episode 1"]
    assert lines[-1].startswith("rl2/GuessTheNumber-v0 with tiny: mean reward")


def test_a_dropped_stream_cancels_its_generations_and_logs_no_error(tiny_dir, tokenizer, caplog):
    """A client that closes a streamed chat completion (two choices, room for 1,500 tokens each)
    after its first event: both generations stop at once (far fewer tokens decoded than asked),
    the engine's slots are free again, the server logs no error and answers the next request."""
    import http.client
    import logging

    from rl2gem.models import load_model
    from rl2gem.rollout import EmbeddedEngine

    model, _ = load_model(str(tiny_dir), device="cpu")
    engine = EmbeddedEngine(model, tokenizer)
    app = make_app(engine, tokenizer=tokenizer, served_model_name="tiny")
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 1500, "n": 2, "stream": True, "temperature": 1.0}
    with caplog.at_level(logging.WARNING), serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        connection.sock.close()  # the client leaves mid-stream
        connection.close()
        deadline = time.monotonic() + 30
        while (engine.load()["num_reqs"] or engine.load()["num_running_reqs"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.load()["num_reqs"] == 0 and engine.load()["num_running_reqs"] == 0
        assert engine.stats["decode_tokens"] < 1500  # cancelled, not run to the end (3,000 tokens)
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
        assert reply.choices[0].message.content is not None
    asyncio.run(engine.close())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_a_burst_of_good_dropped_and_malformed_requests(tiny_dir, tokenizer, caplog):
    """64 requests at once on loopback: 40 good ones (some streamed to the end), 12 streams dropped
    after their first event, 12 malformed. Every good one gets 200 with its choices, every malformed
    one a 400 with an OpenAI-style error body; afterwards the server is healthy, its engine idle, and
    nothing was logged as an error."""
    import logging

    import aiohttp

    from rl2gem.models import load_model
    from rl2gem.rollout import EmbeddedEngine

    model, _ = load_model(str(tiny_dir), device="cpu")
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=16)
    app = make_app(engine, tokenizer=tokenizer, served_model_name="tiny")
    good = {"model": "tiny", "messages": QUESTION, "max_tokens": 4}
    malformed = [
        b"{not json",
        json.dumps({"model": "tiny", "messages": "hi"}).encode(),
        json.dumps({**good, "max_tokens": 10**9}).encode(),
        json.dumps({**good, "temperature": "hot"}).encode(),
    ]

    async def burst(url: str) -> tuple[list, list, list]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def good_request(index: int):
                streamed = index % 4 == 0
                async with session.post(f"{url}/v1/chat/completions", json={**good, "stream": streamed}) as response:
                    if streamed:
                        events = [line async for line in response.content if line.startswith(b"data: ")]
                        return response.status, events[-1] == b"data: [DONE]\n" and len(events) >= 2
                    return response.status, len((await response.json())["choices"]) == 1

            async def dropped_request():
                body = {**good, "max_tokens": 400, "stream": True}
                async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                    first = await response.content.readline()
                    response.close()  # leave mid-stream
                    return response.status, first.startswith(b"data: ")

            async def bad_request(index: int):
                data = malformed[index % len(malformed)]
                headers = {"Content-Type": "application/json"}
                async with session.post(f"{url}/v1/chat/completions", data=data, headers=headers) as response:
                    body = await response.json(content_type=None)
                    return response.status, bool(body["error"]["message"])

            jobs = [good_request(i) for i in range(40)] + [dropped_request() for _ in range(12)]
            jobs += [bad_request(i) for i in range(12)]
            results = await asyncio.gather(*jobs)
        return results[:40], results[40:52], results[52:]

    with caplog.at_level(logging.WARNING), serving(app) as url:
        goods, dropped, bads = asyncio.run(burst(url))
        assert goods == [(200, True)] * 40
        assert dropped == [(200, True)] * 12
        assert bads == [(400, True)] * 12
        deadline = time.monotonic() + 30
        while engine.load()["num_reqs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.load()["num_reqs"] == 0 and engine.load()["num_running_reqs"] == 0
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.status == 200
    asyncio.run(engine.close())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_aiohttp_refusals_carry_error_bodies_too(scripted):
    """An unknown route or a wrong method answers JSON like every other refusal: OpenAI's error
    object under /v1, SGLang's shape elsewhere."""
    _, url = scripted
    cases = [("GET", "/v1/chat/completions", 405), ("POST", "/v1/no_such_route", 404), ("GET", "/no_such_route", 404)]
    for method, path, status in cases:
        request = urllib.request.Request(url + path, method=method, data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == status
        body = json.loads(caught.value.read())
        message = body["error"]["message"] if path.startswith("/v1/") else body["message"]
        assert path in message


def test_each_response_through_the_openai_api_samples_from_its_own_seed(monkeypatch):
    """``responses_per_prompt=3``: the three requests of a task share its reset seed, but each
    carries a sampling seed of its own (one seed made them copies on a server that honours seeds)."""
    sent = []

    class Completions:
        async def create(self, **request):
            sent.append((request["messages"][0]["content"], request["seed"]))
            message = SimpleNamespace(content="\\boxed{5}", tool_calls=None)
            return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=None)

    class Client:
        def __init__(self, **options):
            self.chat = SimpleNamespace(completions=Completions())

        async def close(self):
            pass

    monkeypatch.setattr(openai, "AsyncOpenAI", Client)
    options = ["env=rl2/GSM8K-v0", "n=2", "responses_per_prompt=3", "temperature=1.0", "progress=false"]
    records = evaluate(parse_args([*options, "openai_base_url=http://127.0.0.1:9/v1", "openai_model=m"]))
    assert len(records) == 6 and len(sent) == 6 and len({prompt for prompt, _ in sent}) == 2
    assert len({seed for _, seed in sent}) == 6


def test_a_request_whose_client_left_is_aborted_in_the_engine(server):
    """A client that gives up on a long ``/generate`` (its timeout) frees the engine's row: the
    handler is cancelled when its client disconnects (it generated to max_new_tokens)."""

    def engine_state() -> dict:
        with urllib.request.urlopen(server.url + "/get_server_info", timeout=10) as response:
            return json.loads(response.read())["internal_states"][0]

    before = engine_state()
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    request = urllib.request.Request(
        server.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(OSError):  # the client's timeout: it disconnects
        urllib.request.urlopen(request, timeout=0.3)
    deadline = time.monotonic() + 30
    while (state := engine_state()).get("requests", 0) > state.get("finished", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.get("finish_abort", 0) == before.get("finish_abort", 0) + 1
    assert state.get("finish_length", 0) == before.get("finish_length", 0)


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("bad", [{"top_k": "x"}, {"max_new_tokens": 2.5}, {"sampling_seed": "abc"}, {"top_p": "0.5"}])
def test_a_sampling_parameter_of_the_wrong_type_is_a_400_that_fails_nothing_else(server, bad):
    """Checked where the request is refused alone: in the engine's thread the same value failed
    every request running with it (aborted, reported as stopped)."""
    url = server.url + "/generate"
    status, answer = _post(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, **bad}})
    assert status == 400 and next(iter(bad)) in json.dumps(answer)
    status, answer = _post(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length"


def test_max_tokens_0_and_a_stream_options_that_is_no_object_are_400s(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for extra, named in (({"max_tokens": 0}, "max_tokens"), ({"stream_options": "x"}, "stream_options")):
        status, answer = _post(server.url + "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and named in answer["error"]["message"]  # 0 ran to the context's end; "x" was a 500


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_the_engine_aborts_is_an_error_not_a_stop(server, stream):
    """A pause in abort mode cuts a running chat completion short: the client gets a 503 with an
    error body, or a stream's error event (it got finish_reason "stop": a truncated reply read as
    a finished one)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900}
    body["temperature"] = 0.0  # the tiny model's greedy reply never ends on its own before 1900 tokens
    result = {}

    def request():
        if not stream:
            result["answer"] = _post(server.url + "/v1/chat/completions", body)
            return
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
        try:
            chunks = list(client.chat.completions.create(**body, stream=True))
            result["answer"] = ("finished", chunks[-1].choices[0].finish_reason)
        except openai.APIError as error:
            result["answer"] = ("error", str(error))

    thread = threading.Thread(target=request)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(server.url + "/get_load", timeout=10) as response:
            if json.loads(response.read())[0]["num_reqs"]:
                break
        time.sleep(0.02)
    assert _post(server.url + "/pause_generation", {"mode": "abort"})[0] == 200
    thread.join(60)
    assert _post(server.url + "/continue_generation", {})[0] == 200
    status, answer = result["answer"]
    if stream:
        assert status == "error" and "the engine aborted the request" in answer
    else:
        assert status == 503 and answer["error"]["type"] == "server_error" and "aborted" in answer["error"]["message"]


def test_the_tiny_model_s_greedy_chat_reply_runs_to_its_length(server):
    """What the abort test above stands on: greedy, the reply does not end before 1900 tokens."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900, "temperature": 0.0}
    status, answer = _post(server.url + "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_stop_string_ends_the_generation_where_it_is_met(server, endpoint):
    """The reply stops at the token that completes a stop string: usage and log-probs count no
    token past it, and the engine generates none (it ran to max_tokens, 1900 tokens, cut after)."""
    chat = endpoint == "chat"
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    body = {"model": "tiny", "temperature": 1.0, "seed": 3, "logprobs": True if chat else 0}  # the same tokens twice
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    status, answer = _post(url, {**body, "max_tokens": 40})
    text = answer["choices"][0]["message"]["content"] if chat else answer["choices"][0]["text"]
    stop = text[:1]
    assert status == 200 and stop  # the reply's first character
    status, answer = _post(url, {**body, "max_tokens": 1900, "stop": [stop]})
    choice = answer["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] <= 40
    kept = len(choice["logprobs"]["content"]) if chat else len(choice["logprobs"]["tokens"])
    assert kept == answer["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("logit_bias", {"50": 100}), ("presence_penalty", 1.0), ("frequency_penalty", 0.5),
     ("response_format", {"type": "json_object"}), ("best_of", 2)],
)  # fmt: skip
def test_a_parameter_the_engine_cannot_honour_is_a_400_and_its_no_op_value_passes(server, key, value):
    """Accepted and ignored before (200 with a reply that did not do what was asked)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = _post(server.url + "/v1/chat/completions", {**chat, key: value})
    assert status == 400 and key in answer["error"]["message"]
    no_op = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}
    no_op |= {"response_format": {"type": "text"}, "best_of": 1}
    assert _post(server.url + "/v1/chat/completions", {**chat, key: no_op[key]})[0] == 200
