"""What a server says about itself: DJL's /models and /models/<model>, OpenAI's /v1/models,
the OpenAPI document, and the Prometheus /metrics (DJL's /server/metrics)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from flask import Flask, Response, jsonify

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

from . import metrics, model_status
from .engine_client import EngineClient
from .http_errors import unknown_model

_OPENAPI = Path(__file__).with_name("openapi.yaml")  # every route, request and answer

# A scrape waits this long for a fresh answer: the rolling engine answers between steps (tens
# of ms), engine=Python between batches (seconds), when the engine client's copy serves.
_STATS_TIMEOUT_S = 0.5


class ModelRoutes:
    def __init__(self, runtime: Runtime, client: EngineClient):
        self.runtime = runtime
        self.client = client
        self.name = runtime.model_name
        self.started_at = time.time()
        self.api_document = yaml.safe_load(_OPENAPI.read_text())

    def register(self, app: Flask) -> None:
        app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(self.api_document))
        app.add_url_rule("/v1/models", "openai_models", self.openai_models)
        app.add_url_rule("/models", "list_models", self.list_models)
        app.add_url_rule("/models/<model>", "describe_model", self.describe_model)
        app.add_url_rule("/metrics", "prometheus_metrics", self.prometheus_metrics)
        # DJL's path for its Prometheus text (GET only there too)
        app.add_url_rule("/server/metrics", "server_metrics", self.prometheus_metrics)

    def openai_models(self):
        created = int(self.started_at)
        card = {"id": self.name, "object": "model", "created": created, "owned_by": "lmserve"}
        return jsonify({"object": "list", "data": [card]})

    def list_models(self):
        return jsonify({"models": [self._describe(detailed=False)]})

    def describe_model(self, model: str):
        return unknown_model(model, self.name) or jsonify(self._describe(detailed=True))

    def prometheus_metrics(self):
        body = metrics.render(self._engine_stats(self.client.state()), self.name)
        return Response(body, mimetype="text/plain; version=0.0.4")

    def _describe(self, detailed: bool) -> dict:
        state = self.client.state()
        description = {
            "modelName": self.name,
            "modelUrl": self.runtime.model_source,
            "status": model_status.listed_status(state["state"]),
        }
        if detailed:
            stats = self._engine_stats(state)
            description["status"] = model_status.health_status(state["state"], stats is not None)
            description["config"] = self.runtime.config.to_dict()
            description["engine"] = {**state, "stats": stats}
        return description

    def _engine_stats(self, state: dict) -> dict | None:
        """The engine's stats, fresh or (while a long batch or step keeps it from answering)
        the newest this worker has, at most predict_timeout old: an engine silent for longer
        than a request may take counts as down."""
        if state["state"] != protocol.EngineState.READY:
            return None
        answer = self.client.stats(_STATS_TIMEOUT_S)
        if answer is None or answer[1] > self.runtime.config.predict_timeout:
            return None
        stats, age = answer
        return {**stats, "stats_age_seconds": round(age, 3)}
