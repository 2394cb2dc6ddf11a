"""`GET /openapi.json`: the routes with their real request bodies and error responses.

The POST routes read their bodies themselves (a size check before parsing, the parse off the
event loop), so FastAPI cannot see their schemas; `post_route` declares each body's pydantic
schema and the errors the route answers with, and `install_openapi` puts the bodies' schemas
(and the models they use) under components/schemas. Every error has the API's body, `ErrorBody`.
"""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["ErrorBody", "install_openapi", "post_route", "responses"]

ERRORS = {
    400: "invalid request: an unknown field, a field out of its bounds, a prompt over the "
    "context, a bad template, a schema that cannot be compiled",
    401: "the API key is missing or wrong (when the server has one)",
    404: "no such model",
    413: "the body is larger than the server takes (refused before it is read in full)",
    499: "the client closed the connection before the answer (not sent: nobody reads it)",
    500: "the server failed while generating this request (an OOM, non-finite logits); the "
    "server keeps serving",
    503: "too many requests waiting (--max-queue); retry after the Retry-After header's seconds",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def responses(*statuses: int) -> dict:
    """FastAPI `responses=` for these error statuses, each with ErrorBody."""
    return {s: {"model": ErrorBody, "description": ERRORS[s]} for s in statuses}


def post_route(*bodies: type[BaseModel], streams: bool = True) -> dict:
    """The keywords of a POST route taking one of `bodies` as JSON: their schemas and its
    errors; `streams`: the answer may be server-sent events."""
    refs = [{"$ref": f"#/components/schemas/{body.__name__}"} for body in bodies]
    content = {"application/json": {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}
    answer = {"description": "the answer (JSON)"}
    errors = responses(400, 401, 404, 413)
    if streams:
        answer = {"description": "the answer (JSON), or server-sent events with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}  # fmt: skip
        errors = responses(400, 401, 404, 413, 499, 500, 503)
    return {
        "responses": {200: answer, **errors},
        "openapi_extra": {"requestBody": {"required": True, "content": content}},
    }


def install_openapi(app, bodies: tuple[type[BaseModel], ...] = ()) -> None:
    """Serve the document at /openapi.json with `bodies`' schemas in components/schemas."""
    from fastapi.openapi.utils import get_openapi

    def build() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for body in bodies:
                schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[body.__name__] = schema
            for path in doc["paths"].values():  # no route here answers FastAPI's 422
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build
