"""DJL's adapter management API for LoRA adapters (option.enable_lora):

    GET    /models/<model>/adapters            the adapters served
    POST   /models/<model>/adapters            register one: `name` and `src` (a folder here, or
                                               s3://bucket/prefix, downloaded once into the
                                               cache), as query parameters (DJL's way) or JSON
    GET    /models/<model>/adapters/<name>     one adapter
    DELETE /models/<model>/adapters/<name>     unregister it: new requests for it are refused at
                                               once; requests already running finish with it

The engine owns the list (every web worker sees the same); the front end only fetches an S3
source, since web workers do I/O and no model work. When the ranks span hosts (container/
cluster.py) registration is refused: the adapters served there are those of the model dir's
adapters/ folder, which the start-up probe (container/host_probe.py) compares on every host.
"""

from __future__ import annotations

import queue
import uuid
from pathlib import Path

from flask import Flask, Response, jsonify, request

from lmserve.properties.config import default_cache_dir
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

from .engine_client import EngineClient
from .http_errors import error_response, unknown_model
from .s3_download import S3Error, download_s3_folder


def add_adapter_routes(app: Flask, runtime: Runtime, client: EngineClient) -> None:
    served = runtime.model_name

    @app.get("/models/<model>/adapters")
    def list_adapters(model: str):
        answer = unknown_model(model, served) or _ask(client, runtime, "list")
        if isinstance(answer, Response):
            return answer
        return jsonify({"adapters": answer})

    @app.get("/models/<model>/adapters/<name>")
    def describe_adapter(model: str, name: str):
        answer = unknown_model(model, served) or _ask(client, runtime, "list")
        if isinstance(answer, Response):
            return answer
        for adapter in answer:
            if adapter["name"] == name:
                return jsonify(adapter)
        return error_response(404, f"no LoRA adapter named {name!r}")

    @app.post("/models/<model>/adapters")
    def register_adapter(model: str):
        refusal = unknown_model(model, served)
        if refusal is not None:
            return refusal
        if not runtime.config.enable_lora:  # before fetching anything
            return error_response(
                400, "LoRA adapters are off for this model (option.enable_lora=false)"
            )
        if len(runtime.hosts or ()) > 1:
            return _refuse_across_hosts(runtime.hosts)
        fields = _fields()
        if isinstance(fields, Response):
            return fields
        name, src = fields
        try:
            # Relative to the model dir (serving.properties' folder), as DJL reads paths.
            folder = _local_folder(src, Path(runtime.user_dir or runtime.model_path))
        except (S3Error, ValueError) as error:
            return error_response(400, str(error), field="src")
        answer = _ask(client, runtime, "register", name=name, src=src, path=str(folder))
        if isinstance(answer, Response):
            return answer
        return jsonify({"status": f"Adapter {name} registered", "adapter": answer[0]})

    @app.delete("/models/<model>/adapters/<name>")
    def unregister_adapter(model: str, name: str):
        answer = unknown_model(model, served) or _ask(client, runtime, "unregister", name=name)
        if isinstance(answer, Response):
            return answer
        return jsonify({"status": f"Adapter {name} unregistered", "adapter": answer[0]})


def _refuse_across_hosts(hosts: list[list]) -> Response:
    # The leader alone would fetch the adapter; a rank on another host would fail to read it
    # in the first step that uses it, and that aborts every rank (the job is one MPI world).
    names = ", ".join(str(host) for host, _ in hosts)
    return error_response(
        400,
        f"adapters cannot be registered while serving: this model's ranks span {len(hosts)}"
        f" hosts ({names}) and only this one would have the adapter's files. Put the adapter"
        " in the model dir's adapters/ folder on every host and restart: start-up checks"
        " that every host has the same adapters",
    )


def _fields() -> tuple[str, str] | Response:
    """`name` and `src` from the query (DJL) or a JSON body."""
    body = request.get_json(silent=True) if request.is_json else None
    values = body if isinstance(body, dict) else {}
    found = {key: request.args.get(key) or values.get(key) for key in ("name", "src")}
    for key, value in found.items():
        if not isinstance(value, str) or not value:
            return error_response(
                400, f"{key}: missing (a query parameter or a JSON field)", field=key
            )
    return found["name"], found["src"]


def _local_folder(src: str, model_dir: Path) -> Path:
    """The adapter's folder on this machine: s3:// is fetched into the cache (once), a relative
    path is read against the model dir."""
    if src.startswith("s3://"):
        return download_s3_folder(src, default_cache_dir(), label="src")
    folder = Path(src) if Path(src).is_absolute() else model_dir / src
    if not folder.is_dir():
        raise ValueError(f"src={src!r}: no such folder")
    return folder


def _ask(client: EngineClient, runtime: Runtime, action: str, **fields) -> list | Response:
    """The engine's adapters for a management command, or the error response."""
    command = protocol.AdapterCommand(f"adapters-{uuid.uuid4().hex}", action, **fields)
    events = client.submit(command)
    try:
        event = events.get(timeout=runtime.config.predict_timeout)
    except queue.Empty:
        return error_response(
            503, "the engine did not answer in option.predict_timeout; retry later"
        )
    finally:
        client.finish(command.id, abort=False)
    if isinstance(event, protocol.ErrorEvent):
        return error_response(event.status, event.message)
    return event.adapters
