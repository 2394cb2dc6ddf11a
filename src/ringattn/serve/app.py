"""The HTTP layer (rank 0): FastAPI routes in the OpenAI API's shapes.

    GET  /v1/models             the one model, as {"object": "list", "data": [...]}
    POST /v1/chat/completions   messages -> chat template -> one choice; `stream: true` sends
                                server-sent events, `data: {chat.completion.chunk}` then
                                `data: [DONE]` (a usage chunk first with stream_options)
    POST /v1/completions        prompt (text or token ids) -> one choice, streamed the same way
    GET  /health                200 {"status": "ok", ...} while the server runs
    GET  /metrics               Prometheus text (metrics.py)
    GET  /openapi.json          the endpoints, their bodies and their error responses

A body over `limits.max_body_bytes` is refused unread (413). The rest is parsed and admitted
(schema.py) on one admission thread, off the event loop: a long prompt's template and tokenizer
never hold up another request or `GET /health`. A refusal is an HTTP error with the API's JSON
body and nothing reaches the ranks. Beyond `max_queue` requests waiting (queued, held back by
the scheduler, or being read and admitted) the answer is 503 with Retry-After, given before the
body is read: a flood of large bodies never piles up in memory or before the tokenizer. An
admitted request becomes a `Job` in `jobs`, a queue the worker (main thread) takes from in
order; its events come back on the job's asyncio queue. A client that goes away (a closed
stream, a dropped connection) sets the job's `cancelled`: the worker drops it or ends its
sequence at the next step. With `api_key`, every /v1 route needs `Authorization: Bearer <key>`
(401 otherwise, compared in constant time); /health, /metrics and /openapi.json do not.

FastAPI and uvicorn are the optional `serve` extra, so they are imported inside the functions
that use them (and this module has no `from __future__ import annotations`: FastAPI reads the
routes' `Request` annotations as objects).
"""

import asyncio
import json
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ringattn.serve.metrics import Metrics
from ringattn.serve.openapi import install_openapi, post_route, responses
from ringattn.serve.protocol import Job
from ringattn.serve.schema import APIError, ChatBody, CompletionBody, Limits, admit, parse

RETRY_AFTER_S = 1  # Retry-After of a 503 (the queue is full)
DRAIN_BYTES = 64 << 20  # a refused body is read and dropped up to this, then the line is cut

__all__ = ["build_app", "serve_in_thread"]


def build_app(model_name: str, tokenizer, limits: Limits, jobs: queue.Queue,
              api_key: str | None = None, *, metrics: Metrics | None = None,
              max_queue: int | None = None):  # fmt: skip
    """The FastAPI app; admitted jobs go to `jobs` (see the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    app = FastAPI(title="ringattn serve", docs_url=None, redoc_url=None)
    install_openapi(app, (ChatBody, CompletionBody))
    created = int(time.time())
    metrics = metrics if metrics is not None else Metrics(jobs.qsize)
    admission = ThreadPoolExecutor(1, thread_name_prefix="ringattn-admit")  # one tokenizer user

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(APIError("Incorrect or missing API key: send the header "
                                       "'Authorization: Bearer <key>'", code="invalid_api_key",
                                       status=401))  # fmt: skip
        return await call_next(request)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception):
        return _error(APIError(f"no route {request.method} {request.url.path}", status=404,
                               code="not_found"))  # fmt: skip

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception):
        return _error(APIError(f"method {request.method} not allowed on {request.url.path}",
                               status=405))  # fmt: skip

    @app.get("/health", summary="200 while the server runs")
    async def health() -> dict:
        return {"status": "ok", "running": metrics.running, "waiting": metrics.waiting()}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text format")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name}", responses=responses(401, 404))
    async def model(name: str):
        if name != model_name:
            return _error(_unknown_model(name))
        return _model_card(model_name, created)

    def _admit(raw: bytes, body_type: type):
        body = parse(raw, body_type)
        if body.model is not None and body.model != model_name:
            raise _unknown_model(body.model)
        return body, admit(body, tokenizer, limits)

    admitting = [0]  # requests being read and admitted now (only the event loop counts)

    async def _submit(request: Request, body_type: type):
        try:
            # the bound first: a flood of bodies is refused before one is read or tokenized,
            # and those in admission count as waiting, so at most max_queue are in flight
            waiting = metrics.waiting() + admitting[0]  # queued, held back, in admission
            if max_queue is not None and waiting >= max_queue:
                raise APIError(f"the server has {waiting} requests waiting (--max-queue "
                               f"{max_queue}); retry shortly", code="server_busy", status=503,
                               kind="server_error")  # fmt: skip
            admitting[0] += 1
            try:
                raw = await _read_body(request, limits.max_body_bytes)
                loop = asyncio.get_running_loop()
                body, admitted = await loop.run_in_executor(admission, _admit, raw, body_type)
            finally:
                admitting[0] -= 1
            job = Job(admitted, loop)
        except APIError as err:
            metrics.ended("rejected" if err.status == 503 else "invalid")
            return None, _error(err)
        jobs.put(job)
        return (body, job), None

    @app.post("/v1/chat/completions", **post_route(ChatBody))
    async def chat(request: Request):
        admitted, refused = await _submit(request, ChatBody)
        if refused is not None:
            return refused
        return await _respond(*admitted, "chat.completion", "chatcmpl", model_name, request)

    @app.post("/v1/completions", **post_route(CompletionBody))
    async def completions(request: Request):
        admitted, refused = await _submit(request, CompletionBody)
        if refused is not None:
            return refused
        return await _respond(*admitted, "text_completion", "cmpl", model_name, request)

    return app


async def _read_body(request, limit: int) -> bytes:
    """The body, or APIError 413 once its Content-Length or its bytes pass `limit`: nothing
    more is kept or parsed. The rest is read and dropped (up to DRAIN_BYTES) so that the client,
    still sending, reads the 413 rather than a reset connection."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if max(size, seen) > limit:
            if seen > DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if max(size, seen) > limit:
        raise _too_large(max(size, seen), limit)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(f"the request body has {size} bytes (or more); this server takes up to "
                    f"{limit} (a longer prompt cannot fit the model's context)",
                    code="request_too_large", status=413)  # fmt: skip


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ringattn"}


def _unknown_model(name: str) -> APIError:
    return APIError(f"The model '{name}' does not exist", param="model",
                    code="model_not_found", status=404)  # fmt: skip


def _error(err: APIError):
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _event_error(event: tuple) -> APIError:
    _, message, status = event
    return APIError(message, status=status, code=None if status < 500 else "server_error",
                    kind="invalid_request_error" if status < 500 else "server_error")  # fmt: skip


def _choice(kind: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if kind == "chat.completion":
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}  # fmt: skip
    delta = {"role": "assistant", "content": ""} if first else {}
    if text:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def _respond(body, job: Job, kind: str, prefix: str, model_name: str, request):
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}  # fmt: skip
    if body.stream:
        from fastapi.responses import StreamingResponse

        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_events(job, kind, head, usage), media_type="text/event-stream")
    pieces = []
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                job.cancelled = True  # dropped while waiting, else ended at the next step
                return _error(APIError("the client closed the request", status=499))
            event = event.result()
            if event[0] == "text":
                pieces.append(event[1])
            elif event[0] == "error":
                return _error(_event_error(event))
            else:
                _, finish, usage = event
                choice = _choice(kind, "".join(pieces), finish)
                return {**head, "object": kind, "choices": [choice], "usage": usage}
    finally:
        gone.cancel()


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body is read: the server's next ASGI message for
    this request is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(job: Job, kind: str, head: dict, with_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of one stream; a stream closed before its end (the client gone)
    cancels the job."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    delta_kind = "chat.delta" if kind == "chat.completion" else kind

    def sse(choices: list, **extra) -> str:
        chunk = {**head, "object": chunk_kind, "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    ended = False
    try:
        if kind == "chat.completion":
            yield sse([_choice(delta_kind, None, None, first=True)])
        while True:
            event = await job.events.get()
            if event[0] == "text":
                if event[1]:
                    yield sse([_choice(delta_kind, event[1], None)])
            elif event[0] == "error":
                ended = True
                yield f"data: {json.dumps(_event_error(event).body())}\n\n"
                return
            else:
                ended = True
                _, finish, usage = event
                yield sse([_choice(delta_kind, None, finish)])
                if with_usage:
                    yield sse([], usage=usage)
                yield "data: [DONE]\n\n"
                return
    finally:
        if not ended:
            job.cancelled = True


def serve_in_thread(app, sock) -> tuple[object, threading.Thread]:
    """uvicorn serving `app` on the bound socket `sock` from a daemon thread: (server, thread).

    In a thread uvicorn installs no signal handlers, so SIGTERM and Ctrl-C keep their default
    meaning for the rank (the launcher's teardown works as for any rank)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=1)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="ringattn-http", daemon=True)  # fmt: skip
    thread.start()
    return server, thread
