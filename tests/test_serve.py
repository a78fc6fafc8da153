"""The endpoint (keelrl.serve) as a real server on localhost, driven by the real `openai` client and httpx.

One Endpoint on a float64 tiny Qwen2 (byte tokenizer) serves the whole module; each test uses
its own session ids. What is checked: the OpenAI shape of a completion and that what the
endpoint records is what it sampled (token ids, behaviour log-probs equal to the learner's
recompute), token in / token out across a session's calls (one sample, no re-tokenisation),
tool calls returned and sent back (re-serialised by the harness) still continuing the sample,
a rewritten history starting a new sample without losing a completion, the error shape of
every refusal, fuzzed bodies never giving a 5xx, concurrent sessions decoding together, and a
call whose client went away still being recorded.

Tool calls: a random tiny model never writes a well-formed one, so those tests run on a second
endpoint whose decoder returns scripted completions (`ScriptedDecoder`).

Log-prob tolerance: the samplers compute the logits in float32 whatever the weights' dtype (as
HF's scores; keelrl.inference, tests/test_decoders.py), while the learner's recompute of a
float64 model is float64 throughout. The float64 model removes every difference of the body
(kept keys and values against a full forward), so what is left is float32 rounding of the
logits and their log-sum-exp: a few float32 ulps of values near log(vocab), hence 2e-6. A
misaligned or re-tokenised position is off by nats (checked against a shifted comparison).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

from conftest import action_runs
from keelrl.inference import DecoderOptions, Sample, SamplingParams
from keelrl.policy.model import token_logprobs
from keelrl.policy.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from keelrl.serve import Endpoint, EndpointConfig
from keelrl.serve.render import ROLES, Message, RequestError, Renderer, parse_messages, parse_tools

KEY = "test-key"
MODEL = "keel-policy"
MAX_NEW = 32
"""The endpoint's max_new_tokens: the default and the most a request may ask for."""
CONTEXT = 2048
SPEC = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, max_positions=CONTEXT, seed=3)
LOGPROB_ATOL = 2e-6
"""float32 logits against a float64 recompute (module docstring)."""
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "show a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}}}}}]
SYSTEM = {"role": "system", "content": "You are a careful agent."}


# ---------------------------------------------------------------------- fixtures and helpers
def recompute_logprobs(model, sequences, pad_id: int) -> list[torch.Tensor]:
    """The learner's log pi(token_t | prefix) for every position t >= 1 of each sequence (right-padded batch)."""
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(list(ids))
        attention[row, :len(ids)] = 1
    logp = token_logprobs(model, input_ids, attention)["logp"]
    return [logp[row, :len(ids)] for row, ids in enumerate(sequences)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    return build_tiny_model(SPEC, len(tokenizer), tokenizer.pad_token_id, end).double().eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ep(model, tokenizer):
    config = EndpointConfig(api_key=KEY, max_context_tokens=CONTEXT,
                            sampling=SamplingParams(stop=(), keep_kv=True, max_new_tokens=MAX_NEW),
                            decoder=DecoderOptions(decoder="keel"))
    with Endpoint(model, tokenizer, config) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def client(ep):
    return OpenAI(base_url=ep.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(ep):
    with httpx.Client(base_url=ep.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as session:
        yield session


def post(http: httpx.Client, path: str, body, headers: dict | None = None) -> httpx.Response:
    """POST `body` as JSON text written here (ensure_ascii: a lone surrogate travels as an escape)."""
    response = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
    if response.status_code >= 500:
        # The server logs the exception after answering. Python 3.11 prints a traceback's carets
        # with `ast`, whose state is not thread-safe before 3.11.8 (CPython gh-106905): pytest
        # formatting this test's failure at the same moment dies with "AST constructor recursion
        # depth mismatch" (INTERNALERROR). Let the log finish first.
        time.sleep(0.5)
    return response


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def assert_error(response: httpx.Response, status: int, *, param=..., code=...) -> dict:
    """The OpenAI error shape {"error": {"message", "type", "param", "code"}} with this status."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages through the tokenizer's own chat template, independently of keelrl.serve."""
    return encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def echoed(message) -> dict:
    """The assistant message as a harness sends it back (the openai object dumped, as the example harness does)."""
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def assert_every_completion_in_exactly_one_sample(session) -> None:
    """Each call's completion is one turn of actions in the sample it names, in call order, and
    nothing else is an action: the samples' actions are exactly the calls' completions."""
    for index, sample in enumerate(session.samples):
        mine = [call.completion_ids for call in session.calls if call.sample == index]
        assert action_runs(sample) == mine, f"sample {index}"
        assert sample.sample == index and sample.episode == session.id
        last = [call for call in session.calls if call.sample == index][-1]
        assert sample.token_ids == last.prompt_ids + last.completion_ids  # the sample is its last call's context
    assert sum(s.num_action_tokens for s in session.samples) == sum(len(c.completion_ids) for c in session.calls)
    assert sorted({call.sample for call in session.calls}) == list(range(len(session.samples)))


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# ---------------------------------------------------------------------- a completion, as OpenAI shapes it
def test_a_chat_call_is_an_openai_completion_recorded_token_for_token(ep, client, http, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [SYSTEM, {"role": "user", "content": "Fix the bug in ranges.py."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                       extra_headers={"X-Session-Id": "shape"},
                                       extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and r.model == MODEL and r.id and isinstance(r.created, int)
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    keel = r.model_extra["keel"]
    assert keel["session"] == "shape" and keel["sample"] == 0 and keel["policy_version"] == 0
    assert keel["continued"] is False
    prompt, completion = keel["prompt_token_ids"], keel["completion_token_ids"]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(completion) > 0
    assert r.usage.total_tokens == len(prompt) + len(completion)
    # The prompt is the chat template's rendering of the messages, nothing added.
    assert prompt == template_ids(tokenizer, messages)
    # Finished at an end token or at max_new_tokens, and the content is what was sampled.
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ended = completion[-1] in ep.end_ids
    assert choice.finish_reason == ("stop" if ended else "length")
    assert ended or len(completion) == MAX_NEW
    body = completion[:-1] if ended else completion
    assert choice.message.content == tokenizer.decode(body, skip_special_tokens=True)
    assert end in ep.end_ids
    # What GET /keel/v1/sessions/{id} holds is the same call.
    recorded = http.get("/keel/v1/sessions/shape")
    assert recorded.status_code == 200
    state = recorded.json()
    assert state["session"] == "shape" and state["finished"] is False and state["samples"] == 1
    [call] = state["calls"]
    assert call["prompt_ids"] == prompt and call["completion_ids"] == completion
    assert call["sample"] == 0 and call["version"] == 0 and call["continued"] is False
    assert len(call["logprobs"]) == len(completion) and all(lp <= 0 for lp in call["logprobs"])
    assert call["finish_reason"] == choice.finish_reason
    # logprobs=true gives the recorded behaviour log-probs, one per completion token.
    content = choice.logprobs.content
    assert [entry.logprob for entry in content] == call["logprobs"]
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in completion]
    # The Python side: one sample, prompt then completion, actions exactly the completion.
    session = ep.sessions["shape"]
    [sample] = session.samples
    assert sample.token_ids == prompt + completion and sample.prompt_length == len(prompt)
    assert sample.action_mask == [False] * len(prompt) + [True] * len(completion)
    assert sample.behaviour_logprobs[len(prompt):] == call["logprobs"]


def test_behaviour_logprobs_equal_the_learners_over_one_three_call_sample(ep, client, model, tokenizer):
    messages = [{"role": "user", "content": "Find the failing test."}]
    kept = []
    for turn in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           extra_headers={"X-Session-Id": "exact"},
                                           extra_body={"return_token_ids": True})
        keel = r.model_extra["keel"]
        kept.append((keel["prompt_token_ids"], keel["completion_token_ids"]))
        assert keel["sample"] == 0 and keel["continued"] is (turn > 0)
        messages += [echoed(r.choices[0].message), {"role": "user", "content": f"observation {turn}: 3 tests fail"}]
    # Token in, token out: each prompt is the previous prompt, the previous completion as
    # sampled, then the new messages' tokens (the template's text after the reply).
    for turn, ((prompt, completion), (after, _)) in enumerate(zip(kept, kept[1:])):
        assert after[:len(prompt) + len(completion)] == prompt + completion
        closing = "" if tokenizer.decode(completion[-1:]) == "<|end|>" else "<|end|>"  # one end token between turns
        assert tokenizer.decode(after[len(prompt) + len(completion):]) == \
            f"{closing}<|user|>observation {turn}: 3 tests fail<|end|><|assistant|>"
    session = ep.sessions["exact"]
    [sample] = session.samples
    prompt, completion = kept[-1]
    assert sample.token_ids == prompt + completion
    assert_every_completion_in_exactly_one_sample(session)
    # The learner's log-probs of the sample's tokens are the behaviour log-probs at every action token.
    learner = recompute_logprobs(model, [sample.token_ids], tokenizer.pad_token_id)[0].detach()
    mask = torch.tensor(sample.action_mask)
    behaviour = torch.tensor(sample.behaviour_logprobs, dtype=torch.float64)
    assert int(mask.sum()) == sum(len(c) for _, c in kept)
    torch.testing.assert_close(learner[mask], behaviour[mask], rtol=0, atol=LOGPROB_ATOL)
    assert (behaviour[~mask] == 0).all()
    # The check is sharp: the same comparison one position off is far out.
    shifted = torch.roll(mask, 1)
    assert (learner[shifted] - behaviour[mask]).abs().max() > 1e-2


def test_a_streamed_reply_is_the_same_completion_in_chunks(ep, client):
    messages = [{"role": "user", "content": "stream it"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_headers={"X-Session-Id": "streamed"},
                                                 extra_body={"return_token_ids": True}))
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    [call] = ep.sessions["streamed"].calls
    assert finishes == ["length" if call.finish_reason == "length" else "stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(call.completion_ids)
    assert usage.prompt_tokens == len(call.prompt_ids)
    keel = next(c.model_extra["keel"] for c in chunks if c.model_extra and "keel" in c.model_extra)
    assert keel["completion_token_ids"] == call.completion_ids and keel["session"] == "streamed"
    # The same text a plain reply would have carried.
    body = call.completion_ids[:-1] if call.completion_ids[-1] in ep.end_ids else call.completion_ids
    assert content == ep.tokenizer.decode(body, skip_special_tokens=True)


# ---------------------------------------------------------------------- tool calls
class ScriptedDecoder:
    """A decoder that returns the queued completions in order, as if sampled (log-prob -0.5 per
    token): for replies a random tiny model never writes. Records each context it was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.queue, self.seen = tokenizer, deque(), []
        self.gate = threading.Event()
        """Closed (cleared): a job that arrives is seen, then held until it opens (mid-generation)."""
        self.gate.set()

    takes_uniforms, shares_model, version = True, True, 0

    def generate(self, contexts, params, uniforms=None, caches=None, *, seeds=None):
        out = []
        for context in contexts:
            self.seen.append(list(context))
            if not self.gate.wait(timeout=60):
                raise RuntimeError("the test never opened the gate")
            ids = list(self.queue.popleft())
            out.append(Sample(ids, [-0.5] * len(ids), self.tokenizer.decode(ids), "stop"))
        return out

    def load_weights(self, state, version) -> None:
        self.version = version

    def cache_usage(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def scripted(model, tokenizer):
    """(endpoint, its ScriptedDecoder, an openai client): an endpoint whose completions the test writes."""
    config = EndpointConfig(api_key=KEY, sampling=SamplingParams(stop=(), keep_kv=False, max_new_tokens=64),
                            decoder=DecoderOptions(decoder="hf"))
    endpoint = Endpoint(model, tokenizer, config)
    decoder = ScriptedDecoder(tokenizer)
    assert not endpoint.loop.streaming
    endpoint.loop.decoder = decoder  # before any call: the loop thread only reads it when a job arrives
    with endpoint:
        yield endpoint, decoder, OpenAI(base_url=endpoint.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_reply_finds_hermes_and_json_tool_calls_and_leaves_anything_else_as_content(tokenizer):
    hermes = Renderer(tokenizer, "hermes")
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    tools = parse_tools(TOOLS)
    text = 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.py", "line": 3}}\n</tool_call>'
    reply = hermes.reply(encode(tokenizer, text) + [end], [end], tools)
    assert reply.end_id == end and reply.text == text and reply.token_ids[-1] == end
    assert reply.message == Message(role="assistant", content="Let me look.",
                                    tool_calls=(("read", '{"line": 3, "path": "a.py"}'),))
    assert reply.message.calls() == [{"name": "read", "arguments": {"path": "a.py", "line": 3}}]
    # Without an end token (stopped on the stop string): end_id None, the same message.
    plain = hermes.reply(encode(tokenizer, text), [end], tools)
    assert plain.end_id is None and plain.text == text and plain.message == reply.message
    # Tools not offered (tool_choice none): the whole text is content.
    offered_none = hermes.reply(encode(tokenizer, text), [end], [])
    assert offered_none.message == Message(role="assistant", content=text)
    # Two calls, in order; no text before them.
    two = '<tool_call>{"name": "read", "arguments": {}}</tool_call>\n<tool_call>{"name": "run"}</tool_call>'
    assert hermes.reply(encode(tokenizer, two), [end], tools).message.tool_calls == (("read", "{}"), ("run", "{}"))
    # Malformed: plain content, never an exception.
    for bad in ('<tool_call>{"name": "read", "arguments": {</tool_call>',  # invalid JSON
                '<tool_call>{"name": "read"}',  # unclosed
                '<tool_call>[1, 2]</tool_call>',  # not a call object
                '<tool_call>{"name": "read", "arguments": [1]}</tool_call>'):  # arguments not an object
        message = hermes.reply(encode(tokenizer, bad), [end], tools).message
        assert message == Message(role="assistant", content=bad), bad
    # Special tokens the model wrote are kept in the sampled text, not in the content.
    special = encode(tokenizer, "ab") + [tokenizer.convert_tokens_to_ids("<|user|>")] + encode(tokenizer, "cd")
    odd = hermes.reply(special, [end], tools)
    assert odd.text == "ab<|user|>cd" and odd.message.content == "abcd"
    # The json format: the call object as the whole action.
    as_json = Renderer(tokenizer, "json").reply(encode(tokenizer, ' {"name": "read", "parameters": {"path": "b"}}'),
                                                [end], tools)
    assert as_json.message.tool_calls == (("read", '{"path": "b"}'),) and as_json.message.content == ""
    with pytest.raises(ValueError, match="hermes or json"):
        Renderer(tokenizer, "call")


@pytest.mark.parametrize("with_end_token", [True, False], ids=["ended-on-end-token", "ended-on-stop-string"])
def test_a_tool_call_sent_back_reserialised_continues_the_sample_with_the_sampled_text(scripted, tokenizer,
                                                                                       with_end_token):
    endpoint, decoder, client = scripted
    decoder.queue.clear()  # nothing left over from a test that failed half-way
    sid = f"tools-{with_end_token}"
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    # Written as no harness would re-serialise it: no spaces, "arguments" before "name".
    sampled = 'Reading.\n<tool_call>{"arguments":{"path":"a.py","line":3},"name":"read"}</tool_call>'
    first = encode(tokenizer, sampled) + ([end] if with_end_token else [])
    decoder.queue.extend([first, encode(tokenizer, "done.") + [end], encode(tokenizer, "again.") + [end]])
    user = {"role": "user", "content": "What is on line 3 of a.py?"}
    r1 = client.chat.completions.create(model=MODEL, messages=[user], tools=TOOLS, extra_headers={"X-Session-Id": sid},
                                        extra_body={"return_token_ids": True})
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Reading."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "read" and call.id
    assert json.loads(call.function.arguments) == {"path": "a.py", "line": 3}
    prompt1, completion1 = r1.model_extra["keel"]["prompt_token_ids"], r1.model_extra["keel"]["completion_token_ids"]
    assert completion1 == first
    # The harness sends it back with the arguments written its own way, and the tool's answer.
    reserialised = json.dumps({"line": 3, "path": "a.py"}, indent=2)
    assert reserialised != call.function.arguments
    back = {"role": "assistant", "content": " Reading. ",  # whitespace around it: still the same message
            "tool_calls": [{"id": call.id, "type": "function",
                            "function": {"name": "read", "arguments": reserialised}}]}
    observation = {"role": "tool", "tool_call_id": call.id, "content": "3: return a < b"}
    r2 = client.chat.completions.create(model=MODEL, messages=[user, back, observation], tools=TOOLS,
                                        extra_headers={"X-Session-Id": sid}, extra_body={"return_token_ids": True})
    keel = r2.model_extra["keel"]
    assert keel["continued"] is True and keel["sample"] == 0
    prompt2 = keel["prompt_token_ids"]
    assert prompt2[:len(prompt1) + len(first)] == prompt1 + first  # the sampled tokens, not re-tokenised
    assert decoder.seen[-1] == prompt2  # the decoder was given exactly the recorded context
    # The text: the sampled call as it was written, one end token, then the tool's answer.
    assert tokenizer.decode(prompt2) == (tokenizer.decode(prompt1) + sampled +
                                         "<|end|><|tool|>3: return a < b<|end|><|assistant|>")
    assert reserialised not in tokenizer.decode(prompt2)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "done."
    # Arguments edited by the harness are another message: the history is rewritten, a new sample,
    # in which the harness's call is written by the format (its canonical JSON).
    edited = {**back, "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": "read", "arguments": '{"path": "a.py", "line": 4}'}}]}
    r3 = client.chat.completions.create(model=MODEL, messages=[user, edited, observation, echoed(r2.choices[0].message),
                                                              {"role": "user", "content": "and line 4?"}],
                                        tools=TOOLS, extra_headers={"X-Session-Id": sid},
                                        extra_body={"return_token_ids": True})
    assert r3.model_extra["keel"]["continued"] is False and r3.model_extra["keel"]["sample"] == 1
    text3 = tokenizer.decode(r3.model_extra["keel"]["prompt_token_ids"])
    assert '"line": 4' in text3 and sampled not in text3
    session = endpoint.sessions[sid]
    assert len(session.samples) == 2
    assert_every_completion_in_exactly_one_sample(session)


def test_a_streamed_tool_call_arrives_as_the_openai_client_assembles_it(scripted, tokenizer):
    endpoint, decoder, client = scripted
    decoder.queue.clear()
    decoder.queue.append(encode(tokenizer, 'Reading.<tool_call>{"name": "read", "arguments": {"path": "b.py"}}'
                                           '</tool_call>'))
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b.py?"}],
                                                 tools=TOOLS, stream=True, extra_headers={"X-Session-Id": "stream-call"}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "Reading." and finishes == ["tool_calls"]
    assert [(d.index, d.type, d.function.name) for d in deltas] == [(0, "function", "read")]
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"path": "b.py"} and deltas[0].id


def test_logprobs_bytes_put_together_give_the_replys_text(scripted, tokenizer):
    """OpenAI's `bytes`: each token's own bytes, so that a character split over tokens can be put
    back together. With a byte tokenizer, "é" is two tokens of one byte each."""
    endpoint, decoder, client = scripted
    decoder.queue.clear()
    decoder.queue.append(encode(tokenizer, "héllo"))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say it"}], logprobs=True,
                                       extra_headers={"X-Session-Id": "bytes"})
    entries = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "héllo" and len(entries) == len("héllo".encode())
    assert [entry.logprob for entry in entries] == [-0.5] * len(entries)
    assert b"".join(bytes(entry.bytes) for entry in entries) == "héllo".encode()


def test_calls_group_into_sessions_by_header_else_user_else_each_alone(ep, client):
    def call(messages, **extra):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, **extra).model_extra["keel"]

    first = [{"role": "user", "content": "by user"}]
    a = call(first, user="user-7", extra_body={"return_token_ids": True})
    first_reply = ep.sessions["user-7"].replies[-1].message.content
    b = call([*first, {"role": "assistant", "content": first_reply}, {"role": "user", "content": "more"}],
             user="user-7")
    assert (a["session"], b["session"], b["continued"]) == ("user-7", "user-7", True)
    header = call(first, user="user-7", extra_headers={"X-Session-Id": "header-wins"})
    assert header["session"] == "header-wins" and header["sample"] == 0
    alone = {call(first)["session"] for _ in range(2)}
    assert len(alone) == 2 and not alone & {"user-7", "header-wins"}


# ---------------------------------------------------------------------- rewritten histories
def test_a_rewritten_history_starts_a_new_sample_and_no_completion_is_lost(ep, client, tokenizer):
    sid = "rewrite"

    def call(messages):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           extra_headers={"X-Session-Id": sid}, extra_body={"return_token_ids": True})
        return r, echoed(r.choices[0].message)

    u = [{"role": "user", "content": f"step {i}"} for i in range(6)]
    r1, a1 = call([SYSTEM, u[1]])
    r2, a2 = call([SYSTEM, u[1], a1, u[2]])  # continues
    edited = {"role": "user", "content": "step 1, said otherwise"}
    r3, a3 = call([SYSTEM, edited, a1, u[2], a2, u[3]])  # an earlier message edited: a new sample
    r4, a4 = call([SYSTEM, edited, a1, u[2], a2, u[3], a3, u[4]])  # continues the new sample
    r5, _ = call([SYSTEM, a4, u[5]])  # compacted (messages dropped): a new sample
    r6, _ = call([SYSTEM, u[1]])  # the first call again (a retry): a new sample
    keels = [r.model_extra["keel"] for r in (r1, r2, r3, r4, r5, r6)]
    assert [k["continued"] for k in keels] == [False, True, False, True, False, False]
    assert [k["sample"] for k in keels] == [0, 0, 1, 1, 2, 3]
    session = ep.sessions[sid]
    assert len(session.samples) == 4 and len(session.calls) == 6
    assert_every_completion_in_exactly_one_sample(session)
    # A new sample's prompt is the whole history rendered afresh (each earlier reply as sampled).
    for keel, call_record in zip(keels, session.calls):
        assert call_record.prompt_ids == keel["prompt_token_ids"]
    sampled_a1 = tokenizer.decode([t for t in keels[0]["completion_token_ids"] if t not in ep.end_ids])
    assert sampled_a1 in tokenizer.decode(keels[2]["prompt_token_ids"])
    assert keels[5]["prompt_token_ids"] == keels[0]["prompt_token_ids"]
    for sample, first_call in zip(session.samples, (0, 2, 4, 5)):
        assert sample.prompt_length == len(keels[first_call]["prompt_token_ids"])


# ---------------------------------------------------------------------- refusals, in the OpenAI error shape
def test_an_unknown_model_is_404_model_not_found(client, http):
    with pytest.raises(NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    assert_error(post(http, "/v1/chat/completions", chat_body(model="gpt-4o")), 404, param="model",
                 code="model_not_found")
    assert_error(post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), 404,
                 param="model", code="model_not_found")
    assert_error(http.get("/v1/no/such/route"), 404)


def test_a_missing_or_wrong_api_key_is_401_and_health_needs_none(ep):
    with httpx.Client(base_url=ep.url, timeout=30) as bare:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                 ("GET", "/keel/v1/sessions/shape"), ("POST", "/keel/v1/sessions/shape/reward")):
                response = bare.request(method, path, headers=headers, json=chat_body())
                assert_error(response, 401, code="invalid_api_key")
        health = bare.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    with pytest.raises(AuthenticationError) as info:
        OpenAI(base_url=ep.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401


ASSISTANT_CALL = {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}


def _with_call(arguments) -> list[dict]:
    call = {**ASSISTANT_CALL, "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "read", "arguments": arguments}}]}
    return [{"role": "user", "content": "a"}, call, {"role": "tool", "tool_call_id": "c1", "content": "b"}]


BAD_REQUESTS = {
    "messages not a list": ({"messages": "hi"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "messages missing": ({"messages": None}, "messages"),
    "a message not an object": ({"messages": ["hi"]}, "messages[0]"),
    "bad role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    "no role": ({"messages": [{"content": "x"}]}, "messages[0].role"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "content an object": ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    "an image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                      "messages[0].content"),
    "assistant last": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                       "messages[1]"),
    "arguments not JSON": ({"messages": _with_call("{not json")}, "messages[1].tool_calls"),
    "arguments not an object": ({"messages": _with_call("[1, 2]")}, "messages[1].tool_calls"),
    "tool call without a name": ({"messages": [{"role": "user", "content": "a"},
                                               {**ASSISTANT_CALL, "tool_calls": [{"function": {"arguments": "{}"}}]},
                                               {"role": "user", "content": "b"}]}, "messages[1].tool_calls"),
    "tool_calls on a user message": ({"messages": [{"role": "user", "content": "a",
                                                    "tool_calls": ASSISTANT_CALL["tool_calls"]}]},
                                     "messages[0].tool_calls"),
    "tool_call_id a number": ({"messages": [{"role": "tool", "content": "a", "tool_call_id": 3}]},
                              "messages[0].tool_call_id"),
    "tools not a list": ({"tools": {"name": "read"}}, "tools"),
    "a tool without a function": ({"tools": [{"type": "function"}]}, "tools[0]"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature negative": ({"temperature": -0.1}, "temperature"),
    "temperature a string": ({"temperature": "hot"}, "temperature"),
    "top_p zero": ({"top_p": 0}, "top_p"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "n = 2": ({"n": 2}, "n"),
    "max_tokens too large": ({"max_tokens": MAX_NEW + 1}, "max_tokens"),
    "max_completion_tokens too large": ({"max_completion_tokens": 10_000}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens a float": ({"max_tokens": 4.0}, "max_tokens"),
    "stop not strings": ({"stop": [1, 2]}, "stop"),
    "stop empty string": ({"stop": ""}, "stop"),
    "stop five strings": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "stream not a boolean": ({"stream": "yes"}, "stream"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "stream_options not an object": ({"stream": True, "stream_options": [1]}, "stream_options"),
    "tool_choice required": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice naming a tool": ({"tool_choice": {"type": "function", "function": {"name": "read"}}}, "tool_choice"),
    "seed a string": ({"seed": "7"}, "seed"),
    "user a number": ({"user": 5}, "user"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_malformed_request_is_400_naming_the_param_and_records_nothing(ep, http, name):
    fields, param = BAD_REQUESTS[name]
    before = dict(ep.counters)
    calls = sum(len(s.calls) for s in list(ep.sessions.values()))
    error = assert_error(post(http, "/v1/chat/completions", chat_body(**fields), {"X-Session-Id": "refused"}), 400,
                         param=param)
    assert error["type"] == "invalid_request_error"
    assert ep.counters["rejected"] == before["rejected"] + 1
    assert sum(len(s.calls) for s in list(ep.sessions.values())) == calls
    assert "refused" not in ep.sessions or not ep.sessions["refused"].calls


def test_the_openai_client_sees_a_400_as_bad_request_with_the_param(client):
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], n=2)
    assert info.value.status_code == 400 and info.value.body["param"] == "n"


def test_an_invalid_json_body_is_400(http):
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe{}", b'{"model": "keel-policy",'):
        response = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert_error(response, 400, param=None)
    assert_error(http.post("/keel/v1/sessions/shape/reward", content=b"{oops"), 400)


def test_a_prompt_plus_max_tokens_past_the_context_is_400_context_length_exceeded(ep, http, tokenizer):
    # A prompt exactly MAX_NEW / 2 tokens short of the context: max_tokens up to that fits, one more does not.
    room = MAX_NEW // 2
    content = "x" * (CONTEXT - room - len(template_ids(tokenizer, [{"role": "user", "content": ""}])))
    messages = [{"role": "user", "content": content}]
    assert len(template_ids(tokenizer, messages)) == CONTEXT - room  # the byte tokenizer: one token per "x"
    fits = post(http, "/v1/chat/completions", chat_body(messages=messages, max_tokens=room),
                {"X-Session-Id": "context-fits"})
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == CONTEXT - room
    over = post(http, "/v1/chat/completions", chat_body(messages=messages, max_tokens=room + 1),
                {"X-Session-Id": "context-over"})
    error = assert_error(over, 400, param="messages", code="context_length_exceeded")
    assert str(CONTEXT) in error["message"]
    # Without max_tokens the endpoint's own maximum counts.
    assert_error(post(http, "/v1/chat/completions", {"model": MODEL, "messages": messages}), 400,
                 code="context_length_exceeded")
    assert "context-over" not in ep.sessions or not ep.sessions["context-over"].calls


# ---------------------------------------------------------------------- ending sessions
def test_rewards_end_a_session_once_and_reach_every_sample(ep, client, http):
    assert_error(post(http, "/keel/v1/sessions/never-seen/reward", {"reward": 1.0}), 404, code="session_not_found")
    assert_error(post(http, "/keel/v1/sessions/never-seen/end", {}), 404, code="session_not_found")
    assert_error(http.get("/keel/v1/sessions/never-seen"), 404, code="session_not_found")
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                           extra_headers={"X-Session-Id": "rewarded"})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}], max_tokens=4,
                                   extra_headers={"X-Session-Id": "rewarded"})  # a rewritten history: sample 2
    assert first.model_extra["keel"]["sample"] == 0 and len(ep.sessions["rewarded"].samples) == 2
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {}), 400, param="reward")
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {"reward": "high"}), 400, param="reward")
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {"reward": None}), 400, param="reward")
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {"reward": True}), 400, param="reward")
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {"reward": 1, "success": "yes"}), 400,
                 param="success")
    assert not ep.sessions["rewarded"].finished
    done = post(http, "/keel/v1/sessions/rewarded/reward", {"reward": 0.75})
    assert done.status_code == 200 and done.json() == {"session": "rewarded", "ended": True}
    samples = ep.sessions["rewarded"].samples
    assert [s.reward for s in samples] == [0.75, 0.75] and [s.samples for s in samples] == [2, 2]
    assert all(s.termination == "submitted" and s.success is False and s.partial == 0.75 for s in samples)
    assert http.get("/keel/v1/sessions/rewarded").json()["finished"] is True
    assert_error(post(http, "/keel/v1/sessions/rewarded/reward", {"reward": 1.0}), 409, code="session_ended")
    assert [s.reward for s in ep.sessions["rewarded"].samples] == [0.75, 0.75]  # the second reward changed nothing
    again = post(http, "/v1/chat/completions", chat_body(), {"X-Session-Id": "rewarded"})
    assert_error(again, 409, code="session_ended")
    success = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "c"}], max_tokens=2,
                                             extra_headers={"X-Session-Id": "rewarded-success"})
    assert success.choices
    post(http, "/keel/v1/sessions/rewarded-success/reward", {"reward": 0.0, "success": True})
    assert ep.sessions["rewarded-success"].samples[0].success is True


def test_end_without_a_reward_fn_keeps_the_episode_unfinished_and_with_one_it_is_rewarded(ep, client, http,
                                                                                         monkeypatch):
    for sid in ("ended-plain", "ended-graded"):
        for content in ("a", "b"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=3,
                                           extra_headers={"X-Session-Id": sid})
    plain = post(http, "/keel/v1/sessions/ended-plain/end", {})
    assert plain.status_code == 200 and plain.json() == {"session": "ended-plain", "ended": True, "reward": None}
    samples = ep.sessions["ended-plain"].samples
    assert len(samples) == 2
    assert all(math.isnan(s.reward) and math.isnan(s.partial) and s.termination == "unfinished" and not s.success
               for s in samples)
    assert all(s.error for s in samples)
    assert post(http, "/keel/v1/sessions/ended-plain/end", {}).status_code == 200  # ending twice is harmless
    assert_error(post(http, "/keel/v1/sessions/ended-plain/reward", {"reward": 1.0}), 409, code="session_ended")

    seen = []
    monkeypatch.setattr(ep, "reward_fn", lambda session: seen.append(session.id) or 0.25 * len(session.calls))
    graded = post(http, "/keel/v1/sessions/ended-graded/end", {})
    assert graded.status_code == 200 and graded.json()["reward"] == 0.5
    assert seen == ["ended-graded"]
    assert [(s.reward, s.termination) for s in ep.sessions["ended-graded"].samples] == [(0.5, "submitted")] * 2


# ---------------------------------------------------------------------- fuzzing: never a 5xx
NASTY = ["\ud800", "a\udfffb", "\x00", "<|end|>", "<|assistant|>", "<tool_call>", "</tool_call>",
         "\x00KEEL-REPLY-0\x00", "é💥", ""]
KEYS = ["model", "messages", "role", "content", "tool_calls", "function", "name", "arguments", "type", "text"]
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12) | st.sampled_from(NASTY))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=3), max_leaves=10)
TOOL_CALL = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=4), "type": st.just("function") | JSON,
    "function": st.fixed_dictionaries({}, optional={
        "name": st.sampled_from(["read", ""]) | JSON,
        "arguments": st.sampled_from(['{"path": "a"}', "{}", "{bad", "[1]", "null"]) | JSON})})
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from([*ROLES, "robot"]) | JSON,
    "content": st.text(max_size=24) | st.sampled_from(NASTY) | JSON
               | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2),
    "tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON,
    "tool_call_id": st.text(max_size=4) | JSON,
})
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=4) | JSON
TOOLS_FIELD = st.just(TOOLS) | st.lists(st.fixed_dictionaries({}, optional={
    "type": st.just("function") | JSON,
    "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["read", ""]) | JSON,
                                                    "description": JSON, "parameters": JSON})}), max_size=2) | JSON
BODY = st.fixed_dictionaries({}, optional={
    "model": st.just(MODEL) | st.just(MODEL) | JSON,
    "messages": MESSAGES, "tools": TOOLS_FIELD,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-0.5, 1.5) | JSON,
    "max_tokens": st.integers(-1, 6) | JSON, "max_completion_tokens": st.integers(-1, 6) | JSON,
    "stop": st.lists(st.text(max_size=3), max_size=5) | JSON, "n": st.integers(0, 2) | JSON,
    "seed": st.integers() | JSON, "user": st.text(max_size=4) | JSON, "stream": st.booleans() | JSON,
    "logprobs": st.booleans() | JSON, "return_token_ids": st.booleans() | JSON,
})


@settings(max_examples=60, deadline=None)
@given(body=BODY, extra=st.dictionaries(st.text(max_size=8), JSON, max_size=2),
       session=st.sampled_from([None, "fuzz-a", "fuzz-b"]))
def test_fuzzed_chat_bodies_never_give_a_5xx(ep, http, body, extra, session):
    payload = {**extra, **body}
    if "max_tokens" not in payload and "max_completion_tokens" not in payload:
        payload["max_tokens"] = 2  # a sampled reply is short: the fuzzing is of the request, not the decode
    response = post(http, "/v1/chat/completions", payload, {"X-Session-Id": session} if session else {})
    assert response.status_code < 500, (response.status_code, response.text[:300], payload)
    if response.status_code == 200:
        reply = response.json()
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] >= 1
    else:
        assert_error(response, response.status_code)
        assert 400 <= response.status_code < 500


@settings(max_examples=300, deadline=None)
@given(messages=MESSAGES | st.lists(MESSAGE, min_size=1, max_size=4), tools=TOOLS_FIELD)
def test_fuzzed_messages_and_tools_parse_or_raise_request_error(messages, tools):
    try:
        parsed = parse_messages(messages)
    except RequestError as error:
        assert error.status == 400 and isinstance(error.param, str) and error.param.startswith("messages")
    else:
        assert isinstance(parsed, list) and parsed and all(isinstance(m, Message) for m in parsed)
        assert all(m.role in ROLES and isinstance(m.content, str) for m in parsed)
        assert parsed[-1].role != "assistant"
        for message in parsed:
            for name, arguments in message.tool_calls:
                assert name and isinstance(json.loads(arguments), dict)
    try:
        schemas = parse_tools(tools)
    except RequestError as error:
        assert error.status == 400 and isinstance(error.param, str) and error.param.startswith("tools")
    else:
        assert all(s["type"] == "function" and s["function"]["name"] for s in schemas)


# ---------------------------------------------------------------------- request values no check refuses
@pytest.mark.parametrize("seed", [2**40, 2**62, -2**62, 10**30])
def test_a_large_seed_is_served_or_refused_not_a_500(http, seed):
    response = post(http, "/v1/chat/completions", chat_body(seed=seed), {"X-Session-Id": f"seed-{seed}"})
    if response.status_code != 200:
        assert_error(response, 400, param="seed")


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_number_too_large_for_a_float_is_400_not_a_500(http, field):
    assert_error(post(http, "/v1/chat/completions", chat_body(**{field: 10**400})), 400, param=field)


def test_a_reward_too_large_for_a_float_is_400_not_a_500(client, http):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                   extra_headers={"X-Session-Id": "huge-reward"})
    assert_error(post(http, "/keel/v1/sessions/huge-reward/reward", {"reward": 10**400}), 400, param="reward")


@pytest.mark.parametrize("where", ["content", "tool description"])
def test_a_lone_surrogate_in_the_request_is_400_not_a_500(http, where):
    body = chat_body(messages=[{"role": "user", "content": "a\ud800b"}]) if where == "content" else \
        chat_body(tools=[{"type": "function", "function": {"name": "read", "description": "x\udc00"}}])
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_error(response, 400)


# ---------------------------------------------------------------------- concurrency and clients that go away
def test_concurrent_sessions_decode_together_and_each_continues_its_own_sample(ep, client, model, tokenizer):
    before = dict(ep.loop.decoder.stats)

    def play(index: int) -> list[dict]:
        sid = f"parallel-{index}"
        messages = [{"role": "user", "content": f"task number {index}: " + "z" * (10 * index)}]
        keels = []
        for turn in range(2):
            r = client.chat.completions.create(model=MODEL, messages=messages, extra_headers={"X-Session-Id": sid},
                                               extra_body={"return_token_ids": True})
            keels.append(r.model_extra["keel"])
            messages += [echoed(r.choices[0].message), {"role": "user", "content": f"ok {turn}"}]
        return keels

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(play, range(8)))
    after = ep.loop.decoder.stats
    for index, keels in enumerate(results):
        assert [k["continued"] for k in keels] == [False, True] and [k["sample"] for k in keels] == [0, 0]
        assert all(k["session"] == f"parallel-{index}" for k in keels)
        first, second = keels
        assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["completion_token_ids"])] == \
            first["prompt_token_ids"] + first["completion_token_ids"]
        session = ep.sessions[f"parallel-{index}"]
        assert len(session.samples) == 1 and len(session.calls) == 2
        assert_every_completion_in_exactly_one_sample(session)
    # They decoded together: rows joined a batch in flight, or decode steps ran more than one row.
    joined = after.get("joined_in_flight", 0) - before.get("joined_in_flight", 0)
    rows_per_step = (after["busy_slots"] - before["busy_slots"]) / max(1, after["steps"] - before["steps"])
    assert joined > 0 or rows_per_step > 1, (joined, rows_per_step)
    # Batched with each other, every row's log-probs are still its own (the learner's, alone).
    samples = [ep.sessions[f"parallel-{index}"].samples[0] for index in range(8)]
    learner = recompute_logprobs(model, [s.token_ids for s in samples], tokenizer.pad_token_id)
    for sample, logp in zip(samples, learner):
        mask = torch.tensor(sample.action_mask)
        torch.testing.assert_close(logp.detach()[mask], torch.tensor(sample.behaviour_logprobs,
                                                                     dtype=torch.float64)[mask],
                                   rtol=0, atol=LOGPROB_ATOL)


def _abandoned_call(endpoint, decoder, sid: str, reply: str, while_held=None) -> None:
    """A call whose client gives up while the decoder holds it (mid-generation); `while_held()`
    runs then; the decoder is let go after."""
    end = endpoint.tokenizer.convert_tokens_to_ids("<|end|>")
    decoder.queue.clear()
    decoder.queue.append(encode(endpoint.tokenizer, reply) + [end])
    seen = len(decoder.seen)
    decoder.gate.clear()
    try:
        with httpx.Client(base_url=endpoint.url, headers={"Authorization": f"Bearer {KEY}"}) as gone:
            with pytest.raises(httpx.TimeoutException):
                gone.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "slow one"}]),
                          headers={"X-Session-Id": sid}, timeout=httpx.Timeout(30, read=0.2))
        wait_for(lambda: len(decoder.seen) == seen + 1)  # the job is in the decoder, its client gone
        assert sid in endpoint.sessions and not endpoint.sessions[sid].calls
        if while_held is not None:
            while_held()
    finally:
        decoder.gate.set()
    wait_for(lambda: len(endpoint.sessions[sid].calls) == 1)


def test_a_call_whose_client_gave_up_is_still_recorded_and_the_session_goes_on(scripted, tokenizer):
    endpoint, decoder, client = scripted
    sid = "gone"
    _abandoned_call(endpoint, decoder, sid, "sampled for nobody")
    session = endpoint.sessions[sid]
    [call] = session.calls
    assert call.completion_ids == encode(tokenizer, "sampled for nobody") + [tokenizer.convert_tokens_to_ids("<|end|>")]
    # The harness retries the call it never got an answer to: a new sample; the lost one is kept.
    decoder.queue.append(encode(tokenizer, "second try"))
    retry = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "slow one"}],
                                           max_tokens=4, extra_headers={"X-Session-Id": sid})
    assert retry.model_extra["keel"]["continued"] is False and retry.model_extra["keel"]["sample"] == 1
    assert retry.choices[0].message.content == "second try"
    assert len(session.samples) == 2
    assert_every_completion_in_exactly_one_sample(session)


def test_a_call_still_decoding_when_its_reward_comes_is_recorded_late_and_in_no_sample(scripted):
    """A harness whose call timed out ends the episode with its reward; the call's completion,
    sampled after, is recorded among the session's calls (marked late) but in no sample: the reward
    was given for the episode without it (sessions.py)."""
    endpoint, decoder, _ = scripted
    sid = "late-sample"

    def reward() -> None:
        with httpx.Client(base_url=endpoint.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            rewarded = post(http, f"/keel/v1/sessions/{sid}/reward", {"reward": 1.0})
        assert rewarded.status_code == 200, rewarded.text

    _abandoned_call(endpoint, decoder, sid, "finished after the reward", while_held=reward)
    session = endpoint.sessions[sid]
    assert session.finished and len(session.calls) == 1
    [call] = session.calls
    assert call.late and call.sample == -1 and call.completion_ids  # recorded, token for token
    assert session.samples == []  # nothing to credit: the episode the reward was given for had no completion
    [placeholder] = session.trajectories()
    assert placeholder.termination == "unfinished" and "before it ended" in placeholder.error
