"""The HTTP front end: SageMaker's /ping and /invocations plus DJL's model routes.

gunicorn calls `create_app(RUNTIME_JSON)` in each worker after forking, so each worker opens its
own engine socket and I/O thread. Every response, errors included, is JSON and carries
`x-request-id`; no handler lets a stack trace reach the client.
"""

from __future__ import annotations

import logging
import uuid

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from lmserve.handlers.chat import is_chat, parse_chat
from lmserve.handlers.request_parsing import BadRequest, load_payload, parse_payload
from lmserve.handlers.stream_format import StreamFormat
from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.runtime import Runtime

from . import metrics
from .engine_client import EngineClient
from .predictor import PredictionError, Predictor

log = logging.getLogger("lmserve.http")

# A scrape waits this long for a fresh answer: the rolling engine answers between steps (tens
# of ms), engine=Python between batches (seconds), when the engine client's copy serves.
_STATS_TIMEOUT_S = 0.5
_INFERENCE_ROUTES = ("invocations", "predictions", "chat_completions")


def create_app(runtime_path: str) -> Flask:
    runtime = Runtime.read(runtime_path)
    client = EngineClient(runtime)
    predictor = Predictor(runtime, client)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = runtime.config.max_request_size
    name = runtime.model_name

    @app.before_request
    def assign_request_id() -> None:
        g.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex

    @app.after_request
    def tag_response(response: Response) -> Response:
        response.headers["x-request-id"] = g.get("request_id") or uuid.uuid4().hex
        if request.endpoint in _INFERENCE_ROUTES:
            # Counted in the engine so every gunicorn worker's /metrics agrees.
            client.notify({"op": protocol.OP_COUNT_RESPONSE, "status": response.status_code})
        return response

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        return _error(error.code or 500, error.description or error.name)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(_: RequestEntityTooLarge):
        limit = runtime.config.max_request_size
        return _error(413, f"request body over max_request_size ({limit} bytes)")

    @app.errorhandler(Exception)
    def unexpected_error(error: Exception):
        log.exception("request %s failed inside the front end", g.get("request_id"))
        return _error(500, f"internal error: {type(error).__name__}")

    @app.get("/ping")
    def ping():
        state = client.state()
        if state["state"] == protocol.STATE_READY:
            return jsonify({name: {"status": "Healthy"}})
        if state["state"] == protocol.STATE_FAILED:
            return jsonify({name: {"status": "Failed", "reason": state.get("reason")}}), 500
        return jsonify({name: {"status": "Loading", "reason": state.get("reason")}}), 503

    @app.post("/invocations")
    def invocations():
        requested = request.args.get("model_name") or request.headers.get("model_name")
        return _predict(requested or name)

    @app.post("/predictions/<model>")
    def predictions(model: str):
        return _predict(model)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _predict(name, chat_only=True)

    @app.get("/models")
    def list_models():
        return jsonify({"models": [_describe(detailed=False)]})

    @app.get("/models/<model>")
    def describe_model(model: str):
        if model != name:
            return _error(404, f"model {model!r} not found; this server serves {name!r}")
        return jsonify(_describe(detailed=True))

    def _predict(model: str, chat_only: bool = False):
        if model != name:
            return _error(404, f"model {model!r} not found; this server serves {name!r}")
        state = client.state()
        if state["state"] != protocol.STATE_READY:
            status = 500 if state["state"] == protocol.STATE_FAILED else 503
            return _error(status, f"model {name} is not ready: {state.get('reason', '')}")
        try:
            payload = load_payload(request.get_data(cache=False), request.content_type)
            if chat_only or is_chat(payload):
                chat = parse_chat(payload)
                answer = predictor.chat(chat, g.request_id)
                if chat.stream:
                    return Response(answer, mimetype="text/event-stream")
                return jsonify(answer)
            parsed = parse_payload(payload)
            stream_kind = _stream_kind(parsed.stream, request.headers.get("Accept", ""))
            if stream_kind is None:
                return jsonify(predictor.predict(parsed, g.request_id))
            config = runtime.config
            fmt = StreamFormat(
                stream_kind,
                config.tgi_compat,
                predictor.tokenizer,
                parsed.details,
                parsed.return_full_text,
            )
            return Response(predictor.stream(parsed, g.request_id, fmt), mimetype=fmt.content_type)
        except BadRequest as error:
            return _error(error.status, str(error), field=error.field)
        except PredictionError as error:
            if error.status == 424:
                return _error(424, "prediction failure", error=error.message)
            return _error(error.status, error.message)

    def _stream_kind(asked: bool, accept: str) -> str | None:
        """jsonlines or sse when option.output_formatter or the request asks to stream; a
        streaming request that accepts text/event-stream gets SSE."""
        formatter = runtime.config.output_formatter
        if formatter in ("jsonlines", "sse"):
            return formatter
        if not asked:
            return None
        return "sse" if "text/event-stream" in accept else "jsonlines"

    @app.get("/metrics")
    def prometheus_metrics():
        state = client.state()
        body = metrics.render(_engine_stats(state), name)
        return Response(body, mimetype="text/plain; version=0.0.4")

    def _describe(detailed: bool) -> dict:
        state = client.state()
        description = {
            "modelName": name,
            "modelUrl": runtime.model_source,
            "status": state["state"],
        }
        if detailed:
            description["config"] = runtime.config.to_dict()
            description["engine"] = {**state, "stats": _engine_stats(state)}
        return description

    def _engine_stats(state: dict) -> dict | None:
        """The engine's stats, fresh or (while a long batch or step keeps it from answering)
        the newest this worker has, at most predict_timeout old: an engine silent for longer
        than a request may take counts as down."""
        if state["state"] != protocol.STATE_READY:
            return None
        answer = client.stats(_STATS_TIMEOUT_S)
        if answer is None or answer[1] > runtime.config.predict_timeout:
            return None
        stats, age = answer
        return {**stats, "stats_age_seconds": round(age, 3)}

    return app


def _error(status: int, message: str, **extra) -> tuple[Response, int]:
    body = {"code": status, "message": message, **extra}
    return jsonify(body), status
