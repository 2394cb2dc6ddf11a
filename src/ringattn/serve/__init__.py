"""`ringattn serve`: an OpenAI-compatible HTTP server over context-parallel decoding.

    client (openai)          rank 0                                  ranks 1 .. W-1
    ---------------          ------                                  --------------
    POST /v1/chat/...  -->   app.py: parse, check, chat template,
                             tokenize, context limit (HTTP 400 here:
                             nothing reaches the ranks)
                             a Job in the queue
                             worker.py, main thread:
                               next job (or "idle" each second)
                               broadcast_json(request)  ----------->  the same request
                               ringattn.hf.generate (a batch)         ringattn.hf.generate
                               (prefill sharded, decode merged) <-->  (every rank takes part)
    <-- SSE / JSON           tokens -> text (text.py: stop strings)   the same text, the same stop

protocol.py is what crosses between them: the `Request` (token ids and sampling settings, JSON)
and the `Job` that carries a request's events back to the HTTP thread. The requests waiting
together run as one ragged batch (ringattn.hf.generate with a list of prompts), each answer the
one it gets alone. The HTTP layer (FastAPI + uvicorn, the `serve` extra) is imported by rank 0
only.
"""
