"""The simulator's ASGI app: generation routes as pure ASGI endpoints, plus models, health, metrics, truth.

A generation request is read, validated and tokenized, then handed to the engine, which calls back a
writer at admission and at each chunk. A watcher on ``receive`` notices ``http.disconnect`` while the
request waits, prefills or decodes, and cancels it, which frees its slot at once; a failing ``send``
counts as a disconnect too (uvicorn drops writes to a closed socket silently, other servers raise).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llmtap.errors import ClientGone
from llmtap.simulator.cache import CacheHit, PrefixCache
from llmtap.simulator.embeddings import embeddings_endpoint
from llmtap.simulator.faults import FAULT_HEADER, Fault, FaultPlan
from llmtap.simulator.native import GeminiFormat, OllamaFormat
from llmtap.simulator.parts import reasoning_split
from llmtap.simulator.profiles import Profile
from llmtap.simulator.requests import (
    GenRequest,
    Route as GenRoute,
    SimError,
    output_tokens,
    parse_json,
    parse_request,
)
from llmtap.simulator.responses import ResponsesFormat
from llmtap.simulator.scheduler import Engine, Job
from llmtap.simulator.shapes import ChatFormat, CompletionsFormat, Format, MessagesFormat, Reply
from llmtap.simulator.spans import SpanExporter
from llmtap.simulator.text import Vocabulary, block_hashes_async, tokenize
from llmtap.simulator.truth import RequestRecord, TruthLog, render_metrics
from llmtap.types import Receive, Scope, Send

__all__ = ["create_app"]

_JSON_HEADERS = [(b"content-type", b"application/json")]
# Gemini API paths; the model is a path segment, the method follows a colon.
_GEMINI = "/v1beta/models/{model}"
_BIG_BODY = 64 * 1024


class IdSource:
    """Response ids with 16 hex digits; seeded, the sequence repeats exactly (for tests)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng: random.Random = random.SystemRandom() if seed is None else random.Random(seed)

    def next(self, prefix: str) -> str:
        """A fresh id such as ``chatcmpl-87d565baf524e14a``."""
        return f"{prefix}{self._rng.getrandbits(64):016x}"


@dataclass(slots=True)
class SimState:
    """Everything one simulated server holds."""

    profile: Profile
    vocab: Vocabulary
    cache: PrefixCache
    engine: Engine
    log: TruthLog
    ids: IdSource
    wall_clock: Callable[[], float]
    faults: FaultPlan
    #: Where finished requests' spans go, as vLLM's ``--otlp-traces-endpoint``; None: nowhere.
    spans: SpanExporter | None = None


class _Cut(Exception):
    """A fault asked for the stream to die here: the connection is dropped without an end of body."""


async def _send_all(send: Send, events: list[bytes]) -> None:
    try:
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
    except Exception as exc:  # any failure to write means the peer is gone; the caller records a cancel
        raise ClientGone from exc


class _StreamWriter:
    """Writes one streamed response as the engine produces it."""

    def __init__(
        self, send: Send, fmt: Format, reply: Reply, pieces: list[str], early_prelude: bool, cut_after: int | None
    ) -> None:
        self.send, self.fmt, self.reply, self.pieces, self.early = send, fmt, reply, pieces, early_prelude
        self.cut_after, self.chunks = cut_after, 0

    async def admitted(self, hit: CacheHit) -> None:
        """Fill in the cache facts; send the prelude now if the profile says so."""
        self.reply.cached_tokens, self.reply.created_cache_tokens = hit.cached_tokens, hit.created_tokens
        if self.early:
            await _send_all(self.send, self.fmt.prelude(self.reply))
        if self.cut_after == 0:
            raise _Cut

    async def tokens(self, start: int, end: int) -> None:
        """One chunk of text; the tail follows the last chunk at once. A ``cut-after`` fault ends here."""
        events = [] if self.early or start else self.fmt.prelude(self.reply)
        split = self.reply.reasoning_tokens
        # A chunk that holds the last reasoning tokens and the first answer tokens is written as two events.
        for a, b in ((start, split), (split, end)) if start < split < end else ((start, end),):
            events += self.fmt.chunk(self.reply, "".join(self.pieces[a:b]), b)
        self.chunks += 1
        if self.chunks == self.cut_after:
            await _send_all(self.send, events)
            raise _Cut
        if end == self.reply.output_tokens:
            events += self.fmt.tail(self.reply, "".join(self.pieces[split:end]))
        await _send_all(self.send, events)


class _BodyWriter:
    """Collects nothing: a whole body is written from the reply once the engine is done."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    async def admitted(self, hit: CacheHit) -> None:
        """Fill in the cache facts."""
        self.reply.cached_tokens, self.reply.created_cache_tokens = hit.cached_tokens, hit.created_tokens

    async def tokens(self, start: int, end: int) -> None:
        """Nothing to send until the end."""


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` until it ends or the client leaves; False when the client left (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            pending.cancel()
        # Wait for the work's ``finally`` (the slot release) before the record is closed.
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled() or isinstance(task.exception(), ClientGone):
        return False
    task.result()  # a real failure propagates
    return True


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


@dataclass(slots=True)
class _Work:
    """One admitted generation: its record, the reply's facts, its text, the engine's job and the wire shape."""

    record: RequestRecord
    reply: Reply
    pieces: list[str]
    job: Job
    fmt: Format


class GenerateEndpoint:
    """One generation route (chat, completions, responses, messages, Ollama's, Gemini's) as a pure ASGI app."""

    def __init__(self, state: SimState, route: GenRoute, fmt: Format) -> None:
        self.state, self.route, self.fmt = state, route, fmt

    def format_for(self, scope: Scope) -> Format:
        """The protocol's shape for this request; one route may speak several framings."""
        return self.fmt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request and record its truth, whatever happens."""
        record = RequestRecord(id="", route=self.route, arrival=time.monotonic())
        try:
            await self._serve(record, scope, receive, send)
        except asyncio.CancelledError:
            record.outcome = "cancelled"  # the server is shutting down
            raise
        except Exception as exc:
            record.status, record.outcome, record.error = 500, "error", repr(exc)
            raise
        finally:
            self.state.log.finish(record)
            if self.state.spans is not None:
                self.state.spans.finished(record, _header(scope, b"traceparent"))

    async def _serve(self, record: RequestRecord, scope: Scope, receive: Receive, send: Send) -> None:
        st, profile, fmt = self.state, self.state.profile, self.format_for(scope)
        body = await _read_body(receive)
        if body is None:
            record.outcome = "cancelled"
            return
        try:
            fault = st.faults.for_request(_header(scope, FAULT_HEADER))
            req, ids, n, hashes = await self._read(record, scope, body)
        except SimError as err:
            record.status, record.outcome, record.error = err.status, "error", err.message
            await _send_json(send, err.status, fmt.error(err))
            return
        if fault is not None and not await _fault_first(record, fault, fmt, receive, send):
            return
        reply = Reply(
            id=st.ids.next(fmt.id_prefix),
            created=int(st.wall_clock()),
            model=req.model,
            fingerprint=profile.system_fingerprint,
            prompt_tokens=len(ids),
            output_tokens=n,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            truth=record,
            openai_chunks=profile.openai_chunks,
            choices=req.parts.choices,
            reasoning_tokens=reasoning_split(n, req.parts.reasoning),
            tool=req.parts.tool,
        )
        record.id = reply.id
        pieces = st.vocab.generate(req.prompt_text, n)
        reply.reasoning_text = "".join(pieces[: reply.reasoning_tokens])
        job = Job(prompt_tokens=len(ids), block_hashes=hashes, output_tokens=n)
        if req.stream:
            await self._stream(_Work(record, reply, pieces, job, fmt), fault, receive, send)
        else:
            if not await _until_disconnect(receive, st.engine.run(job, record, _BodyWriter(reply))):
                record.outcome = "cancelled"
                return
            await _send_json(send, 200, fmt.body(reply, "".join(pieces[reply.reasoning_tokens :])))

    async def _read(
        self, record: RequestRecord, scope: Scope, body: bytes
    ) -> tuple[GenRequest, list[int], int, list[bytes]]:
        """The request, its prompt's token ids, the tokens to write and the prompt's block hashes; or ``SimError``."""
        profile = self.state.profile
        # A multi-megabyte body takes tens of ms to decode: off the loop, like the tokenizing below.
        payload = await asyncio.to_thread(parse_json, body) if len(body) > _BIG_BODY else parse_json(body)
        req = parse_request(self.route, payload, profile, path_model=scope.get("path_params", {}).get("model"))
        record.model, record.stream = req.model, req.stream
        ids = await tokenize(req.prompt_text, profile.encoding)
        record.prompt_tokens = len(ids)
        record.max_tokens = n = output_tokens(req, len(ids), profile)
        hashes = await block_hashes_async(ids, profile.block_size)
        return req, ids, n, hashes

    async def _stream(self, work: _Work, fault: Fault | None, receive: Receive, send: Send) -> None:
        """Write a streamed answer; a ``cut-after`` fault returns mid-body, so the server drops the connection."""
        st, record, fmt = self.state, work.record, work.fmt
        # Headers go out before the request is even admitted, as vLLM's StreamingResponse does.
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", fmt.stream_type)]})
        cut = fault.cut_after if fault is not None else None
        writer = _StreamWriter(send, fmt, work.reply, work.pieces, st.profile.prelude_on_admit, cut)
        try:
            if not await _until_disconnect(receive, st.engine.run(work.job, record, writer)):
                record.outcome = "cancelled"
                return
        except _Cut:
            record.outcome, record.error = "error", f"fault: cut-after={cut}"
            return  # uvicorn closes a connection whose response did not complete: no end of body reaches the client
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The request header ``name`` (lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


async def _fault_first(record: RequestRecord, fault: Fault, fmt: Format, receive: Receive, send: Send) -> bool:
    """Play what a fault does before any work: wait the first-byte delay, then answer its status. False when the
    request ends here (answered, or the client left during the delay)."""
    if fault.first_byte_delay and not await _until_disconnect(receive, asyncio.sleep(fault.first_byte_delay)):
        record.outcome = "cancelled"
        return False
    if fault.status is None:
        return True
    err = SimError(fault.status, f"simulated fault ({fault.describe()})", kind="InternalServerError")
    record.status, record.outcome, record.error = fault.status, "error", f"fault: {fault.describe()}"
    await _send_json(send, fault.status, fmt.error(err))
    return False


class GeminiStreamEndpoint(GenerateEndpoint):
    """``:streamGenerateContent``: SSE events with ``?alt=sse``, else the elements of one JSON array."""

    def __init__(self, state: SimState) -> None:
        super().__init__(state, "gemini_stream", GeminiFormat(sse=True))
        self._array = GeminiFormat(sse=False)

    def format_for(self, scope: Scope) -> Format:
        """SSE only when the query asks for it (``alt=sse``), as Google's API does."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return self.fmt if query.get("alt") == ["sse"] else self._array


def _models(state: SimState) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def models(request: Request) -> Response:
        created = int(state.wall_clock())
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": state.profile.model,
                "parent": None,
                "max_model_len": state.profile.max_model_len,
                "permission": [],
            }
            for name in state.profile.served_models
        ]
        return JSONResponse({"object": "list", "data": data})

    return models


def _metrics(state: SimState) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def metrics(request: Request) -> Response:
        text = render_metrics(
            state.log,
            model=state.profile.model,
            running=state.engine.running,
            waiting=state.engine.waiting,
            cache_blocks=len(state.cache),
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return metrics


def _debug_requests(state: SimState) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def debug_requests(request: Request) -> Response:
        try:
            since = int(request.query_params.get("since", "0"))
            limit = int(request.query_params.get("limit", "0")) or None
        except ValueError:
            return JSONResponse({"detail": "since and limit must be integers"}, status_code=400)
        records = [r.as_json() for r in state.log.since(since, limit)]
        body = {
            "now": time.monotonic(),
            "last_seq": state.log.last_seq,
            "running": state.engine.running,
            "waiting": state.engine.waiting,
            "requests": records,
        }
        return JSONResponse(body)

    return debug_requests


async def _health(request: Request) -> Response:
    return Response(status_code=200)


def create_app(
    profile: Profile,
    *,
    seed: int | None = None,
    clock: Callable[[], float] = time.time,
    faults: FaultPlan | None = None,
    spans: SpanExporter | None = None,
) -> Starlette:
    """The simulated server for ``profile``; ``seed`` fixes the id sequence, ``clock`` the ``created`` times,
    ``faults`` what goes wrong on requests that do not ask (``llmtap.simulator.faults``), ``spans`` where each
    request's span goes (``llmtap.simulator.spans``)."""
    cache = PrefixCache(profile.block_size, profile.cache_blocks)
    state = SimState(
        profile=profile,
        vocab=Vocabulary(profile.encoding),  # checks the word list now, not on the first request
        cache=cache,
        engine=Engine(profile, cache),
        log=TruthLog(profile.history),
        ids=IdSource(seed),
        wall_clock=clock,
        faults=faults or FaultPlan(seed=seed),
        spans=spans,
    )
    ollama_chat = OllamaFormat(generate=False, clock=clock)
    ollama_generate = OllamaFormat(generate=True, clock=clock)
    routes = [
        Route("/v1/chat/completions", GenerateEndpoint(state, "chat", ChatFormat()), methods=["POST"]),
        Route("/v1/completions", GenerateEndpoint(state, "completions", CompletionsFormat()), methods=["POST"]),
        Route("/v1/responses", GenerateEndpoint(state, "responses", ResponsesFormat()), methods=["POST"]),
        Route("/v1/messages", GenerateEndpoint(state, "messages", MessagesFormat()), methods=["POST"]),
        Route("/api/chat", GenerateEndpoint(state, "ollama_chat", ollama_chat), methods=["POST"]),
        Route("/api/generate", GenerateEndpoint(state, "ollama_generate", ollama_generate), methods=["POST"]),
        Route(
            f"{_GEMINI}:generateContent", GenerateEndpoint(state, "gemini", GeminiFormat(sse=False)), methods=["POST"]
        ),
        Route(f"{_GEMINI}:streamGenerateContent", GeminiStreamEndpoint(state), methods=["POST"]),
        Route("/v1/embeddings", embeddings_endpoint(profile, ollama=False), methods=["POST"]),
        Route("/api/embed", embeddings_endpoint(profile, ollama=True), methods=["POST"]),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Route("/debug/requests", _debug_requests(state), methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.sim = state
    return app
