"""The HTTP side of `ringattn serve`, on rank 0 only: the FastAPI routes (app.py), the request
bodies and their bounds (schema.py), the responses built from a request's events (choices.py)
and the OpenAPI document (openapi.py). The ranks' side (worker, scheduler, runner, pool) never
imports it but through worker.py, which starts the app on rank 0."""
