"""Acceptance: `lmserve serve` with `option.model_id=s3://...` downloads the model from an
S3-compatible endpoint (AWS_ENDPOINT_URL), serves it, and reuses the download on restart."""

from __future__ import annotations

import requests

from lmserve.container.s3_download import s3_cache_path

from ..servers import Server, write_properties
from .s3_server import folder_contents, upload_folder

URL = "s3://bucket/models/tiny"


def serve(folder, s3_server, cache):
    return Server(folder, env={**s3_server.env(), "LMSERVE_CACHE_DIR": str(cache)})


def test_serves_a_model_from_s3(s3, s3_server, tiny_model_dir, tmp_path):
    s3.create_bucket(Bucket="bucket")
    uploaded = upload_folder(s3, tiny_model_dir, "bucket", "models/tiny")
    folder = write_properties(
        tmp_path / "model",
        {"engine": "Python", "option.rolling_batch": "disable", "option.model_id": URL},
    )
    cache = tmp_path / "cache"

    server = serve(folder, s3_server, cache)
    try:
        server.wait_healthy()
        response = requests.post(
            f"{server.url}/invocations",
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert isinstance(response.json()["generated_text"], str)
        (model,) = requests.get(f"{server.url}/models", timeout=10).json()["models"]
        assert model["modelUrl"] == URL
        assert model["modelName"] == "tiny"
        downloaded = s3_cache_path(URL, cache)
        assert [p.name for p in (cache / "s3").iterdir()] == [downloaded.name]
        assert folder_contents(downloaded) == uploaded
    finally:
        assert server.stop() == 0, server.log()

    # A restart serves the cached copy: S3 is not asked again (the bucket is gone).
    for key in uploaded:
        s3.delete_object(Bucket="bucket", Key=f"models/tiny/{key}")
    s3.delete_bucket(Bucket="bucket")
    again = serve(folder, s3_server, cache)
    try:
        again.wait_healthy()
        answer = requests.post(f"{again.url}/invocations", json={"inputs": "Hi"}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        assert again.stop() == 0, again.log()


def test_missing_s3_model_stops_start_up_with_a_message(s3, s3_server, tmp_path):
    s3.create_bucket(Bucket="bucket")
    folder = write_properties(
        tmp_path / "model",
        {"engine": "Python", "option.rolling_batch": "disable", "option.model_id": URL},
    )

    server = serve(folder, s3_server, tmp_path / "cache")
    code = server.process.wait(timeout=60)
    log = server.log()

    assert code == 2, log
    assert f"option.model_id='{URL}': no objects under this prefix" in log
    assert "Traceback" not in log
    assert server.stop() == 2
