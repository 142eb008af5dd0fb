"""The HTTP front end: SageMaker's /ping and /invocations plus DJL's and OpenAI's routes.

gunicorn calls `create_app(RUNTIME_JSON)` in each worker after forking, so each worker opens its
own engine socket and I/O thread. Every response, errors included, is JSON and carries
`x-request-id`; no handler lets a stack trace reach the client. The routes live by concern:
inference_routes.py (/ping and the inference routes), model_routes.py (models, OpenAPI,
metrics), adapter_routes.py (LoRA adapters).
"""

from __future__ import annotations

import logging
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from lmserve.handlers.custom.forwarding_handler import ForwardingHandler
from lmserve.handlers.interface import Handler
from lmserve.handlers.llm_handler import LLMHandler
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

from .adapter_routes import add_adapter_routes
from .engine_client import EngineClient
from .http_errors import error_response
from .inference_routes import INFERENCE_ENDPOINTS, InferenceRoutes
from .model_routes import ModelRoutes

log = logging.getLogger("lmserve.http")


def create_app(runtime_path: str) -> Flask:
    runtime = Runtime.read(runtime_path)
    client = EngineClient(runtime)
    # A user's handle() runs in the engine process; lmserve's LLM handler runs here.
    handler: Handler = (
        LLMHandler(runtime, client)
        if runtime.entry_point is None
        else ForwardingHandler(runtime, client)
    )
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = runtime.config.max_request_size
    _tag_requests(app, client)
    _answer_errors_as_json(app, runtime)
    InferenceRoutes(runtime, client, handler).register(app)
    ModelRoutes(runtime, client).register(app)
    add_adapter_routes(app, runtime, client)
    return app


def _tag_requests(app: Flask, client: EngineClient) -> None:
    """Every request gets an id (the client's x-request-id, else a new one), echoed in the
    answer; every inference answer's status is counted."""

    @app.before_request
    def assign_request_id() -> None:
        g.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex

    @app.after_request
    def tag_response(response: Response) -> Response:
        response.headers["x-request-id"] = g.get("request_id") or uuid.uuid4().hex
        if request.endpoint in INFERENCE_ENDPOINTS:
            # Counted in the engine so every gunicorn worker's /metrics agrees.
            client.notify(protocol.CountResponse(response.status_code))
        return response


def _answer_errors_as_json(app: Flask, runtime: Runtime) -> None:
    @app.errorhandler(HTTPException)
    def httperror_response(error: HTTPException):
        return error_response(error.code or 500, error.description or error.name)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(_: RequestEntityTooLarge):
        limit = runtime.config.max_request_size
        return error_response(413, f"request body over max_request_size ({limit} bytes)")

    @app.errorhandler(Exception)
    def unexpectederror_response(error: Exception):
        log.exception("request %s failed inside the front end", g.get("request_id"))
        return error_response(500, f"internal error: {type(error).__name__}")
