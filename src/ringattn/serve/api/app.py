"""The HTTP layer (rank 0): FastAPI routes in the OpenAI API's shapes.

    GET  /v1/models             the one model, as {"object": "list", "data": [...]}: its id
                                is --model-name, else --hf as given (the basename is accepted)
    POST /v1/chat/completions   messages (+ tools) -> chat template -> n choices; `stream: true`
                                sends server-sent events, `data: {chat.completion.chunk}` then
                                `data: [DONE]` (a usage chunk first with stream_options)
    POST /v1/completions        prompts (text or token ids, one or a list) -> n choices each,
                                streamed the same way; logprobs, echo (choices.py)
    POST /tokenize, /detokenize, GET /tokenizer_info   the served tokenizer, in vLLM's shapes
                                (tokenize.py; lm-eval's "remote" tokenizer)
    GET  /health                200 {"status": "ok", ...} while the server runs
    GET  /metrics               Prometheus text (metrics.py)
    GET  /openapi.json          the endpoints, their bodies and their error responses

A body over `limits.max_body_bytes` is refused unread (413). The rest is parsed and admitted
(schema.py) on one admission thread, off the event loop: a long prompt's template and tokenizer
never hold up another request or `GET /health`. A refusal is an HTTP error with the API's JSON
body and nothing reaches the ranks. Beyond `max_queue` requests waiting (queued, held back by
the scheduler, or being read and admitted) the answer is 503 with Retry-After, given before the
body is read: a flood of large bodies never piles up in memory or before the tokenizer. An
admitted request becomes one `Job` per choice in `jobs`, a queue the worker (main thread) takes
from in order; their events come back on one asyncio queue. A client that goes away (a closed
stream, a dropped connection) sets the jobs' `cancelled`: the worker drops them or ends their
sequences at the next step. With `api_key`, every /v1 route needs `Authorization: Bearer <key>`
(401 otherwise, compared in constant time), and so do the tokenizer routes; /health, /metrics
and /openapi.json do not.

FastAPI and uvicorn are the optional `serve` extra, so they are imported inside the functions
that use them (and this module has no `from __future__ import annotations`: FastAPI reads the
routes' `Request` annotations as objects).
"""

import asyncio
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ringattn.serve.api import tokenize
from ringattn.serve.api.choices import Choice, gather, stream
from ringattn.serve.api.grammar import Grammars
from ringattn.serve.api.openapi import install_openapi, post_route, responses
from ringattn.serve.api.schema import (
    APIError,
    ChatBody,
    CompletionBody,
    Limits,
    admit,
    parse,
    prompts_of,
    tools_of,
)
from ringattn.serve.metrics import Metrics
from ringattn.serve.protocol import Job

TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
RETRY_AFTER_S = 1  # Retry-After of a 503 (the queue is full)
DRAIN_BYTES = 64 << 20  # a refused body is read and dropped up to this, then the line is cut

__all__ = ["build_app", "serve_in_thread"]


def build_app(model_name: str, tokenizer, limits: Limits, jobs: queue.Queue,
              api_key: str | None = None, *, metrics: Metrics | None = None,
              max_queue: int | None = None, aliases: tuple[str, ...] = ()):  # fmt: skip
    """The FastAPI app; admitted jobs go to `jobs` (see the module docstring). Requests may
    name the model `model_name` (what /v1/models lists and answers carry) or one of `aliases`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    app = FastAPI(title="ringattn serve", docs_url=None, redoc_url=None)
    install_openapi(app, (ChatBody, CompletionBody, tokenize.TokenizeCompletionBody,
                          tokenize.TokenizeChatBody, tokenize.DetokenizeBody))  # fmt: skip
    created = int(time.time())
    metrics = metrics if metrics is not None else Metrics(jobs.qsize)
    admission = ThreadPoolExecutor(1, thread_name_prefix="ringattn-admit")  # one tokenizer user
    grammars = Grammars(tokenizer, limits.vocab_size, list(limits.eos))  # (its user too)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        if api_key is not None and (path.startswith("/v1") or path in TOKENIZER_ROUTES):
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

    @app.get("/v1/models/{name:path}", responses=responses(401, 404))
    async def model(name: str):
        if name != model_name and name not in aliases:
            return _error(_unknown_model(name))
        return _model_card(model_name, created)

    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name and name not in aliases:
            raise _unknown_model(name)

    def _admit(raw: bytes, body_type: type):
        body = parse(raw, body_type)
        _check_model(body.model)
        return body, admit(body, tokenizer, limits, grammars)

    async def _tokenizer_call(request: Request, work):
        """A tokenizer route's body through `work` on the admission thread (the one user of
        the tokenizer), its model checked; the answer or the error."""
        try:
            raw = await _read_body(request, limits.max_body_bytes)
            loop = asyncio.get_running_loop()
            name, answer = await loop.run_in_executor(admission, work, raw, tokenizer, limits)
            _check_model(name)
        except APIError as err:
            return _error(err)
        return answer

    @app.post("/tokenize", **post_route(tokenize.TokenizeCompletionBody,
                                        tokenize.TokenizeChatBody, streams=False))  # fmt: skip
    async def tokenize_route(request: Request):
        return await _tokenizer_call(request, tokenize.tokenize)

    @app.post("/detokenize", **post_route(tokenize.DetokenizeBody, streams=False))
    async def detokenize_route(request: Request):
        return await _tokenizer_call(request, tokenize.detokenize)

    @app.get("/tokenizer_info", responses=responses(401))
    async def tokenizer_info() -> dict:
        return tokenize.tokenizer_info(tokenizer, limits)

    def _choices(body, jobs: list[Job], kind: str) -> list[Choice]:
        """One Choice per job; completions with echo start with their prompt's text."""
        echo = [None] * len(jobs)
        if kind == "text_completion" and body.echo:
            texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts_of(body)]
            echo = [texts[i // body.n] for i in range(len(jobs))]
        tools = kind == "chat.completion" and tools_of(body) is not None
        return [Choice(i, kind, job, tokenizer, tools, echo[i], body.stream)
                for i, job in enumerate(jobs)]  # fmt: skip

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
                body, requests = await loop.run_in_executor(admission, _admit, raw, body_type)
            finally:
                admitting[0] -= 1
            events: asyncio.Queue = asyncio.Queue()  # every choice's events, by index
            made = [Job(r, loop, events, i) for i, r in enumerate(requests)]
        except APIError as err:
            metrics.ended("rejected" if err.status == 503 else "invalid")
            return None, _error(err)
        for job in made:
            jobs.put(job)
        return (body, made, events), None

    async def _complete(request: Request, body_type: type, kind: str, prefix: str):
        """Admit a chat or completions body and answer it (streamed or whole)."""
        admitted, refused = await _submit(request, body_type)
        if refused is not None:
            return refused
        body, made, events = admitted
        choices = _choices(body, made, kind)
        return await _respond(body, choices, events, kind, prefix, model_name, request)

    @app.post("/v1/chat/completions", **post_route(ChatBody))
    async def chat(request: Request):
        return await _complete(request, ChatBody, "chat.completion", "chatcmpl")

    @app.post("/v1/completions", **post_route(CompletionBody))
    async def completions(request: Request):
        return await _complete(request, CompletionBody, "text_completion", "cmpl")

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


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body is read: the server's next ASGI message for
    this request is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(body, choices: list[Choice], events: asyncio.Queue, kind: str, prefix: str,
                   model_name: str, request):  # fmt: skip
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}  # fmt: skip
    if body.stream:
        from fastapi.responses import StreamingResponse

        usage = body.stream_options is not None and body.stream_options.include_usage
        parts = stream(choices, body.n, events, head, usage)
        return StreamingResponse(parts, media_type="text/event-stream")
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        whole, usage = await gather(choices, body.n, events, gone)
    except APIError as err:
        return _error(err)
    finally:
        gone.cancel()
    return {**head, "object": kind, "choices": whole, "usage": usage}


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
