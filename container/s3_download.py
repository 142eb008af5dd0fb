"""`s3://bucket/prefix` -> a local folder, synced once into the cache and reused.

The folder is keyed by the URL's hash and only published (renamed into place) after every object
arrived, so a download killed halfway is redone, never half-used. boto3 honours
`AWS_ENDPOINT_URL`, credentials and region from the environment as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


class S3Error(RuntimeError):
    pass


def split_s3_url(url: str, label: str = "option.model_id") -> tuple[str, str]:
    without_scheme = url.removeprefix("s3://")
    bucket, _, prefix = without_scheme.partition("/")
    if not bucket:
        raise S3Error(f"{label}={url!r}: expected s3://bucket/prefix")
    return bucket, prefix.rstrip("/")


def s3_cache_path(url: str, cache_dir: Path) -> Path:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return cache_dir / "s3" / digest


def download_s3_folder(url: str, cache_dir: Path, label: str = "option.model_id") -> Path:
    """`label` names where the URL came from in errors (the option, or a request's field)."""
    destination = s3_cache_path(url, cache_dir)
    if destination.is_dir():
        log.info("model %s: using the cached copy in %s", url, destination)
        return destination
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError
    from tqdm import tqdm

    bucket, prefix = split_s3_url(url, label)
    client = boto3.client("s3")
    partial = destination.with_name(destination.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        objects = _list_objects(client, bucket, prefix)
        if not objects:
            raise S3Error(f"{label}={url!r}: no objects under this prefix")
        total = sum(size for _, size in objects)
        log.info("downloading %d files (%.1f MB) from %s", len(objects), total / 1e6, url)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {url}") as progress:
            for key, _ in objects:
                target = _local_path(partial, key[len(prefix) :], f"{label}={url!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, key, str(target), Callback=progress.update)
    except (BotoCoreError, ClientError, OSError, S3Error) as error:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, S3Error):
            raise
        raise S3Error(f"{label}={url!r}: {error}") from None
    destination.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, destination)
    return destination


def _local_path(folder: Path, relative_key: str, source: str) -> Path:
    """Where an object lands; a key that would climb out of the folder (`..`) is refused."""
    parts = [part for part in relative_key.split("/") if part not in ("", ".")]
    if ".." in parts or not parts:
        raise S3Error(f"{source}: refusing object key {relative_key!r}")
    return folder.joinpath(*parts)


def _list_objects(client, bucket: str, prefix: str) -> list[tuple[str, int]]:
    # "prefix" names a folder: match "prefix/..." only, never "prefix-other/...".
    folder = f"{prefix}/" if prefix else ""
    paginator = client.get_paginator("list_objects_v2")
    return [
        (item["Key"], item["Size"])
        for page in paginator.paginate(Bucket=bucket, Prefix=folder)
        for item in page.get("Contents", [])
        if not item["Key"].endswith("/")
    ]
