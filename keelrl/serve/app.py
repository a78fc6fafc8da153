"""`keel serve`: an OpenAI-compatible chat-completions endpoint over the policy, recording every call.

Routes (FastAPI, served by uvicorn on 127.0.0.1 unless told otherwise):

    GET  /v1/models                          the one model served
    POST /v1/chat/completions                messages, tools, tool_choice auto|none, temperature, top_p,
                                             max_tokens (or max_completion_tokens), stop, seed, user,
                                             logprobs; the reply's tool_calls where the completion
                                             holds well-formed calls in the tool-call format
    POST /keel/v1/sessions/{id}/reward       {"reward": R, "success"?: bool, "group"?: str}: the episode
                                             ends with R (filed under the harness's group, e.g. its task)
    POST /keel/v1/sessions/{id}/end          the episode ends: rewarded by the endpoint's reward_fn,
                                             else kept unfinished (never trained on)
    GET  /keel/v1/sessions/{id}              what was recorded: every call's token ids, log-probs, version
    POST /keel/v1/episodes                   (training) the next episode keelrl hands out: a session id,
                                             its task, its first messages and its tools
    POST /keel/v1/episodes/{id}/step         (training) the environment runs the episode's latest
                                             completion: {"observation", "done", "reward"?}
    GET  /health

Calls group into episodes by session id: the `X-Session-Id` header, else the `user` field; a
call with neither is an episode of its own. With an API key, every route but /health answers
401 without `Authorization: Bearer KEY`. Bad requests get a 4xx in the OpenAI error shape
{"error": {"message", "type", "param", "code"}}: an unknown model is 404 (model_not_found), a
prompt whose length plus max_tokens passes the context is 400 (context_length_exceeded), a
malformed body or message list is 400 naming the field.

Sampling. `keel serve` honours a request's temperature, top_p, max_tokens and stop. An endpoint
that a training run feeds from (`fixed_sampling`) samples at the run's temperature and top_p
whatever a request asks (the learner's ratios are taken at that temperature), caps max_tokens
at the run's rollout.max_new_tokens, and counts the requests it overrode.

Streaming: with stream=true the reply comes as server-sent events in the chat.completion.chunk
shape (role and content, then tool calls, then the finish reason, then usage when
stream_options.include_usage, then [DONE]), all sent once the completion is sampled: the events
are the protocol's, not token by token.

Not supported: n > 1, tool_choice naming a tool or "required", continuing a final assistant
message, images.
"""



import asyncio
import hashlib
import itertools
import json
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch

from keelrl.inference import (DecoderOptions, Sample, SamplingParams, draw_seed, draw_uniforms, end_token_ids,
                              token_byte_table)
from keelrl.serve.render import Message, RequestError, Renderer, parse_messages, parse_tools
from keelrl.serve.service import DecodeLoop, Job
from keelrl.serve.sessions import CallRecord, Session

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class EndpointConfig:
    """How the endpoint serves (its fields are `keel serve`'s options)."""

    model_name: str = "keel-policy"
    """The model id requests must name (GET /v1/models lists it)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port (the bound one is `Endpoint.url`)."""
    api_key: str = ""
    """When set, requests without `Authorization: Bearer KEY` get 401."""
    tool_format: str = "hermes"
    """How tool calls are written in completions (keelrl.envs.formats: hermes or json)."""
    max_context_tokens: int = 2048
    """A prompt plus max_tokens past this is refused (400 context_length_exceeded)."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(stop=(), keep_kv=True, max_new_tokens=256))
    """Defaults of a request's sampling; `max_new_tokens` is the most a request may ask for."""
    decoder: DecoderOptions = field(default_factory=DecoderOptions)
    """The decoder that samples (rollout.decoder, its dtype and KV budget)."""
    fixed_sampling: bool = False
    """Sample at `sampling`'s temperature and top_p whatever a request asks (a training run's endpoint)."""
    seed: int = 0
    """Seeds each session's sampling generator (with its id), unless the request gives `seed`."""


class EpisodeSource(Protocol):
    """What hands out episodes whose tools keelrl runs (a training run's engine: keelrl.serve.engine)."""

    def claim(self) -> Any:
        """The next episode's ticket, or None when none may be handed out now; never blocks (the route
        polls). Raises RequestError 410 once the run needs no more."""

    def open(self, ticket: Any) -> Session:
        """The claimed episode's session, its environment made and reset."""

    def describe(self, session: Session) -> dict[str, Any]:
        """The episode's task, first messages and tools, as POST /keel/v1/episodes returns them."""

    def step(self, session: Session) -> dict[str, Any]:
        """Run the session's latest completion in its environment; the route's reply."""

    def cut(self, session: Session, why: str) -> None:
        """The session's context is full: end and grade it (termination context_limit)."""

    def ended(self, session: Session) -> None:
        """A session ended (rewarded or unfinished)."""


class Endpoint:
    """The server: sessions, the decode loop and the HTTP app; a context manager that runs
    uvicorn in a thread (`url` is where it listens once entered)."""

    def __init__(self, model: Any, tokenizer: Any, config: EndpointConfig = EndpointConfig(), *,
                 version: int = 0, source: EpisodeSource | None = None,
                 reward_fn: Callable[[Session], float] | None = None, decode_thread: bool = True) -> None:
        """`decode_thread`: sample in a thread of the endpoint's own; False: in the thread that calls
        `serve` (`keel serve` samples on the main thread, where torch ran faster on 2-core CPUs)."""
        self.config, self.tokenizer, self.source, self.reward_fn = config, tokenizer, source, reward_fn
        self.renderer = Renderer(tokenizer, config.tool_format)
        self.end_ids = tuple(end_token_ids(tokenizer))
        self.loop = DecodeLoop(model, tokenizer, config.decoder, version=version, thread=decode_thread)
        self.sessions: dict[str, Session] = {}
        self.counters = {"requests": 0, "rejected": 0, "sampling_overridden": 0, "new_samples": 0,
                         "continued": 0}
        self._lock = threading.Lock()
        self._anonymous = itertools.count()
        self._byte_table: Any = False
        """Each token's bytes (keelrl.inference.token_byte_table), made on first use; None: not byte-level."""
        self.app = build_app(self)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ------------------------------------------------------------------ sessions
    def session(self, session_id: str, seed: int | None = None) -> Session:
        """The session with this id, made on first use (its generator seeded by id and seed)."""
        with self._lock:
            found = self.sessions.get(session_id)
            if found is None:
                digest = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:7], "big")
                base = self.config.seed if seed is None else seed
                found = Session(id=session_id,
                                generator=torch.Generator().manual_seed((base * 1_000_003 + digest) % (2**63 - 1)))
                self.sessions[session_id] = found
            return found

    def add(self, session: Session) -> None:
        with self._lock:
            self.sessions[session.id] = session

    def set_reward(self, session_id: str, reward: float, success: bool | None = None) -> None:
        """End an episode with `reward` (the Python side of POST /keel/v1/sessions/{id}/reward)."""
        session = self._existing(session_id)
        number = _finite(reward)
        if number is None:
            raise RequestError(f"reward must be a finite number, got {str(reward)[:40]}", param="reward")
        with session.lock:
            first = session.finish(number, success=success)
        if not first:
            raise RequestError(f"session {session_id!r} has already ended", param="session", code="session_ended",
                               status=409)
        if self.source is not None:
            self.source.ended(session)

    def end(self, session_id: str) -> Session:
        """End an episode without a reward: `reward_fn` gives it one, else it is kept unfinished."""
        session = self._existing(session_id)
        with session.lock:
            if self.reward_fn is not None and not session.finished:
                first = session.finish(float(self.reward_fn(session)))
            else:
                first = session.abandon("the harness ended the episode without a reward")
        if first and self.source is not None:
            self.source.ended(session)
        return session

    def _existing(self, session_id: str) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(f"no session {session_id!r}", param="session", code="session_not_found", status=404)
        return session

    # ------------------------------------------------------------------ one chat call
    def sampling_for(self, body: dict[str, Any]) -> SamplingParams:
        """The request's sampling settings (RequestError naming a bad one)."""
        base = self.config.sampling
        temperature, top_p = _number(body, "temperature", 0.0, 2.0), _number(body, "top_p", 0.0, 1.0)
        if top_p is not None and top_p <= 0:
            raise RequestError("top_p must be in (0, 1]", param="top_p")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise RequestError(f"max_tokens must be a positive integer, got {asked!r}", param="max_tokens")
        max_new = base.max_new_tokens if asked is None else min(asked, base.max_new_tokens)
        if asked is not None and asked > base.max_new_tokens and not self.config.fixed_sampling:
            raise RequestError(f"max_tokens={asked} is more than this endpoint's {base.max_new_tokens}",
                               param="max_tokens")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise RequestError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
        stops = tuple(dict.fromkeys(base.stop + tuple(stop or ()) + tuple(self.renderer.fmt.stop)))
        if self.config.fixed_sampling:
            if (temperature is not None and temperature != base.temperature) or \
                    (top_p is not None and top_p != base.top_p):
                self.counters["sampling_overridden"] += 1
            return replace(base, max_new_tokens=max_new, stop=stops)
        temperature = base.temperature if temperature is None else temperature
        if temperature == 0:
            temperature = 0.0
        return replace(base, temperature=temperature, top_p=base.top_p if top_p is None else top_p,
                       max_new_tokens=max_new, stop=stops)

    async def complete(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        """POST /v1/chat/completions: render, sample, record; the OpenAI reply."""
        self.counters["requests"] += 1
        if body.get("model") != self.config.model_name:
            raise RequestError(f"The model {body.get('model')!r} does not exist; this endpoint serves "
                               f"{self.config.model_name!r}", param="model", code="model_not_found", status=404)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false", param="stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise RequestError("stream_options must be an object, and only with stream=true", param="stream_options")
        n = body.get("n", 1)
        if n is not None and (n != 1 or isinstance(n, bool)):
            raise RequestError("n must be 1", param="n")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise RequestError("tool_choice must be 'auto' or 'none'", param="tool_choice")
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body.get("tools"))
        cfg = self.sampling_for(body)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < 2**63):
            raise RequestError("seed must be a 64-bit integer", param="seed")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise RequestError("user must be a string", param="user")
        session_id = session_id or user or f"call-{next(self._anonymous)}"
        session = self.session(session_id, seed)
        session.last_seen = time.monotonic()
        async with session.call_lock:  # one call of a session at a time; checked once it is this call's turn
            if session.finished:
                raise RequestError(f"session {session_id!r} has ended; use a new session id", param="session",
                                   code="session_ended", status=409)
            if session.env is not None and not session.stepped:
                raise RequestError(f"session {session_id!r}: step the environment with the latest completion "
                                   f"(POST /keel/v1/episodes/{session_id}/step) before the next call",
                                   param="messages", code="step_first", status=409)
            return await self._complete(session, messages, tools, cfg, choice, body)

    async def _complete(self, session: Session, messages: list[Message], tools: list[dict[str, Any]],
                        cfg: SamplingParams, choice: Any, body: dict[str, Any]) -> dict[str, Any]:
        offered = tools if choice != "none" else []
        with session.lock:
            rendered = self.renderer.continuation(messages, tools, session.replies, session.previous_text,
                                                  session.previous_context)
        if len(rendered.token_ids) + cfg.max_new_tokens > self.config.max_context_tokens:
            why = (f"This model's maximum context length is {self.config.max_context_tokens} tokens; the messages "
                   f"have {len(rendered.token_ids)} and max_tokens is {cfg.max_new_tokens}")
            if self.source is not None and session.env is not None:
                await asyncio.to_thread(self.source.cut, session, why)
            raise RequestError(why, param="messages", code="context_length_exceeded")
        at = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        observation = "\n\n".join(m.content for m in messages[at + 1:])
        future: asyncio.Future[tuple[CallRecord, Any]] = asyncio.get_running_loop().create_future()
        event_loop = asyncio.get_running_loop()

        def done(sample: Sample, version: int) -> None:
            reply = self.renderer.reply(sample.token_ids, self.end_ids, offered)
            with session.lock:
                session.kv = None if session.finished else sample.cache
                call = session.record(rendered, reply, sample.logprobs, version, sample.stopped, observation,
                                      sample.text)
                session.last_text, session.stepped = sample.text, session.env is None
            self.counters["continued" if rendered.continues else "new_samples"] += 1
            event_loop.call_soon_threadsafe(_settle, future, (call, reply), None)

        def failed(error: BaseException) -> None:
            event_loop.call_soon_threadsafe(_settle, future, None, error)

        uniforms, seed = None, None
        if self.loop.takes_uniforms:
            uniforms = draw_uniforms(session.generator, cfg.max_new_tokens)
        else:
            seed = draw_seed(session.generator)
        self.loop.submit(Job(context=list(rendered.token_ids), params=cfg, uniforms=uniforms, seed=seed, done=done,
                             failed=failed, cache=session.kv if cfg.keep_kv else None))
        call, reply = await future
        return self._response(session, call, reply, body)

    def _response(self, session: Session, call: CallRecord, reply: Any, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.message.content or None}
        finish = "length" if call.finish_reason == "length" else "stop"
        if reply.message.tool_calls:
            message["tool_calls"] = [{"id": f"call_{session.turns}_{i}_{hashlib.sha1(session.id.encode()).hexdigest()[:8]}",
                                      "type": "function", "function": {"name": name, "arguments": arguments}}
                                     for i, (name, arguments) in enumerate(reply.message.tool_calls)]
            finish = "tool_calls" if finish == "stop" else finish
        elif message["content"] is None:
            message["content"] = ""
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": list(self._token_bytes(t)),
                 "top_logprobs": []}
                for t, lp in zip(call.completion_ids, call.logprobs)]}
        keel: dict[str, Any] = {"session": session.id, "sample": call.sample, "policy_version": call.version,
                                "continued": call.continued}
        if body.get("return_token_ids"):
            keel.update(prompt_token_ids=call.prompt_ids, completion_token_ids=call.completion_ids)
        return {"id": f"chatcmpl-{session.id}-{session.turns}", "object": "chat.completion", "created": int(time.time()),
                "model": self.config.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids),
                          "total_tokens": len(call.prompt_ids) + len(call.completion_ids)},
                "keel": keel}

    def _token_bytes(self, token: int) -> bytes:
        """A token's own bytes (a byte-level tokenizer's table: a token may hold part of a character),
        else its decoded text's."""
        if self._byte_table is False:
            self._byte_table = token_byte_table(self.tokenizer)
        if self._byte_table is not None and token < len(self._byte_table):
            return self._byte_table[token]
        return self.tokenizer.decode([token]).encode("utf-8")

    # ------------------------------------------------------------------ the server
    def __enter__(self) -> "Endpoint":
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="keel-endpoint",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {host}:{port}")
            time.sleep(0.01)
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve(self, until: Callable[[], bool]) -> None:
        """Sample in the calling thread until `until()` is true (an endpoint made with decode_thread=False)."""
        self.loop.run(until)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.loop.close()


def stream_chunks(reply: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A chat.completion reply as the chat.completion.chunk events a streaming client reads."""
    head = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": reply["model"]}
    choice = reply["choices"][0]
    message = choice["message"]
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": message.get("content")},
                                    "logprobs": choice.get("logprobs"), "finish_reason": None}]}]
    if message.get("tool_calls"):
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks.append({**head, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "keel": reply["keel"]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": reply["usage"]})
    return chunks


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    number = _finite(value)
    if number is None or not low <= number <= high:
        raise RequestError(f"{name} must be a number in [{low:g}, {high:g}], got {str(value)[:40]}", param=name)
    return number


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not a number or not one a float holds."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def build_app(endpoint: Endpoint) -> Any:
    """The FastAPI app of `endpoint` (module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="keelrl endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, *, param: str | None = None, code: str | None = None,
              kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                                    "param": param, "code": code}})

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        if request.url.path == "/v1/chat/completions":
            endpoint.counters["rejected"] += 1
        return JSONResponse(status_code=exc.status, content=exc.body())

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, str(exc))

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        key = endpoint.config.api_key
        if key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if given != f"Bearer {key}":
                return error(401, "Incorrect or missing API key: send Authorization: Bearer KEY",
                             code="invalid_api_key")
        return await call_next(request)

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("the request body holds a string that is not valid Unicode (a lone surrogate)") \
                from None
        return body

    @app.get("/health")
    async def _health() -> dict[str, Any]:
        return {"status": "ok", "policy_version": endpoint.loop.version}

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": endpoint.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "keelrl"}]}

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Any:
        from fastapi.responses import StreamingResponse

        body = await json_body(request)
        reply = await endpoint.complete(body, request.headers.get(SESSION_HEADER))
        if not body.get("stream"):
            return reply
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(reply, include_usage)]
        return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")

    @app.post("/keel/v1/sessions/{session_id}/reward")
    async def _reward(session_id: str, request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if "reward" not in body:
            raise RequestError("the body needs a reward: {\"reward\": R}", param="reward")
        success = body.get("success")
        if success is not None and not isinstance(success, bool):
            raise RequestError("success must be true or false", param="success")
        group = body.get("group")
        if group is not None and not isinstance(group, str):
            raise RequestError("group must be a string", param="group")
        if group:
            endpoint._existing(session_id).group = group
        endpoint.set_reward(session_id, body["reward"], success)
        return {"session": session_id, "ended": True}

    @app.post("/keel/v1/sessions/{session_id}/end")
    async def _end(session_id: str) -> dict[str, Any]:
        session = endpoint.end(session_id)
        reward = session.samples[0].reward if session.samples else math.nan
        return {"session": session_id, "ended": True, "reward": None if math.isnan(reward) else reward}

    @app.get("/keel/v1/sessions/{session_id}")
    async def _recorded(session_id: str) -> dict[str, Any]:
        session = endpoint._existing(session_id)
        with session.lock:
            return {"session": session_id, "finished": session.finished, "samples": len(session.samples),
                    "calls": [call.to_dict() for call in session.calls]}

    @app.post("/keel/v1/episodes")
    async def _episode(request: Request) -> dict[str, Any]:
        source = endpoint.source
        if source is None:
            raise RequestError("this endpoint hands out no episodes (it is not a training run's)", status=404,
                               code="no_episodes")
        body = await json_body(request)
        wait = _number(body, "wait_s", 0.0, 600.0)
        deadline = time.monotonic() + (30.0 if wait is None else wait)
        while True:  # polled on the event loop: a client that gives up while waiting takes no episode
            ticket = source.claim()
            if ticket is not None:
                break
            if time.monotonic() >= deadline:
                raise RequestError("no episode is ready yet; ask again", status=503, code="retry")
            await asyncio.sleep(0.02)
        session = await asyncio.to_thread(source.open, ticket)
        endpoint.add(session)
        return source.describe(session)

    @app.post("/keel/v1/episodes/{session_id}/step")
    async def _step(session_id: str) -> dict[str, Any]:
        session = endpoint._existing(session_id)
        if endpoint.source is None or session.env is None:
            raise RequestError(f"session {session_id!r} has no environment to step", status=404,
                               code="no_environment")
        return await asyncio.to_thread(endpoint.source.step, session)

    return app
