"""The HTTP layer (rank 0): FastAPI routes in the OpenAI API's shapes.

    GET  /v1/models             the one model, as {"object": "list", "data": [...]}
    POST /v1/chat/completions   messages -> chat template -> one choice; `stream: true` sends
                                server-sent events, `data: {chat.completion.chunk}` then
                                `data: [DONE]` (a usage chunk first with stream_options)
    POST /v1/completions        prompt (text or token ids) -> one choice, streamed the same way

Each body is parsed and admitted (schema.py) here, in the HTTP thread; a refusal is an HTTP
error with the API's JSON body and nothing reaches the ranks. An admitted request becomes a
`Job` in `jobs`, a queue the worker (main thread) takes from in order; its events come back on
the job's asyncio queue. With `api_key`, every route needs `Authorization: Bearer <key>` (401
otherwise, compared in constant time).

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

from ringattn.serve.protocol import Job
from ringattn.serve.schema import APIError, ChatBody, CompletionBody, Limits, admit, parse

__all__ = ["build_app", "serve_in_thread"]


def build_app(model_name: str, tokenizer, limits: Limits, jobs: queue.Queue,
              api_key: str | None = None):  # fmt: skip
    """The FastAPI app; admitted jobs go to `jobs` (see the module docstring)."""
    from fastapi import FastAPI, Request

    app = FastAPI(title="ringattn serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None:
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

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != model_name:
            return _error(_unknown_model(name))
        return _model_card(model_name, created)

    async def _submit(request: Request, body_type: type):
        try:
            body = parse(await request.body(), body_type)
            if body.model is not None and body.model != model_name:
                raise _unknown_model(body.model)
            job = Job(admit(body, tokenizer, limits), asyncio.get_running_loop())
        except APIError as err:
            return None, _error(err)
        jobs.put(job)
        return (body, job), None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        admitted, refused = await _submit(request, ChatBody)
        if refused is not None:
            return refused
        return await _respond(*admitted, "chat.completion", "chatcmpl", model_name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        admitted, refused = await _submit(request, CompletionBody)
        if refused is not None:
            return refused
        return await _respond(*admitted, "text_completion", "cmpl", model_name)

    return app


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ringattn"}


def _unknown_model(name: str) -> APIError:
    return APIError(f"The model '{name}' does not exist", param="model",
                    code="model_not_found", status=404)  # fmt: skip


def _error(err: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status)


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


async def _respond(body, job: Job, kind: str, prefix: str, model_name: str):
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}  # fmt: skip
    if body.stream:
        from fastapi.responses import StreamingResponse

        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_events(job, kind, head, usage), media_type="text/event-stream")
    pieces = []
    while True:
        event = await job.events.get()
        if event[0] == "text":
            pieces.append(event[1])
        elif event[0] == "error":
            return _error(APIError(event[1]))
        else:
            _, finish, usage = event
            choice = _choice(kind, "".join(pieces), finish)
            return {**head, "object": kind, "choices": [choice], "usage": usage}


async def _events(job: Job, kind: str, head: dict, with_usage: bool) -> AsyncIterator[str]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    delta_kind = "chat.delta" if kind == "chat.completion" else kind

    def sse(choices: list, **extra) -> str:
        chunk = {**head, "object": chunk_kind, "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    if kind == "chat.completion":
        yield sse([_choice(delta_kind, None, None, first=True)])
    while True:
        event = await job.events.get()
        if event[0] == "text":
            if event[1]:
                yield sse([_choice(delta_kind, event[1], None)])
        elif event[0] == "error":
            yield f"data: {json.dumps(APIError(event[1]).body())}\n\n"
            return
        else:
            _, finish, usage = event
            yield sse([_choice(delta_kind, None, finish)])
            if with_usage:
                yield sse([], usage=usage)
            yield "data: [DONE]\n\n"
            return


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
