"""`option.model_id=s3://bucket/prefix`: downloaded once, over HTTP from a real S3-compatible
server, into a folder keyed by the URL and published only when complete."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from lmserve.container.s3_download import S3Error, download_s3_folder, s3_cache_path

from .s3_server import folder_contents, upload_folder

URL = "s3://bucket/models/tiny"


def leftovers(cache_dir: Path) -> list[str]:
    """Anything a download left in the cache besides published folders."""
    s3_root = cache_dir / "s3"
    if not s3_root.is_dir():
        return []
    return sorted(p.name for p in s3_root.iterdir() if ".partial-" in p.name)


@pytest.fixture
def tiny_in_s3(s3, tiny_model_dir: Path) -> dict[str, bytes]:
    """The tiny model under s3://bucket/models/tiny/ with one nested file, and a decoy model
    under the sibling prefix models/tiny-other/."""
    s3.create_bucket(Bucket="bucket")
    expected = upload_folder(s3, tiny_model_dir, "bucket", "models/tiny")
    s3.put_object(Bucket="bucket", Key="models/tiny/extra/nested/notes.txt", Body=b"nested")
    expected["extra/nested/notes.txt"] = b"nested"
    s3.put_object(Bucket="bucket", Key="models/tiny/empty-folder/", Body=b"")  # console folder
    s3.put_object(Bucket="bucket", Key="models/tiny-other/decoy.bin", Body=b"not this model")
    s3.put_object(Bucket="bucket", Key="models/tiny-other/config.json", Body=b"{}")
    return expected


def test_boto3_follows_aws_endpoint_url(s3, s3_server):
    # The product creates its client with plain boto3.client("s3"): it must reach this server.
    explicit = boto3.client("s3", endpoint_url=s3_server.url)
    explicit.create_bucket(Bucket="seen-over-http")
    names = [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
    assert names == ["seen-over-http"]


def test_downloads_the_prefix_byte_identical(tiny_in_s3, tmp_path):
    folder = download_s3_folder(URL, tmp_path)

    assert folder == s3_cache_path(URL, tmp_path)
    assert folder.parent == tmp_path / "s3"
    assert folder_contents(folder) == tiny_in_s3  # the decoy and folder markers not included
    assert (folder / "extra" / "nested" / "notes.txt").read_bytes() == b"nested"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(tiny_in_s3)
    assert leftovers(tmp_path) == []


def test_cache_is_keyed_by_url(tiny_in_s3, tmp_path):
    assert s3_cache_path(URL + "/", tmp_path) == s3_cache_path(URL, tmp_path)
    assert s3_cache_path("s3://bucket/models/tiny-other", tmp_path) != s3_cache_path(URL, tmp_path)
    tiny = download_s3_folder(URL, tmp_path)
    other = download_s3_folder("s3://bucket/models/tiny-other", tmp_path)

    assert other != tiny
    assert folder_contents(other) == {"decoy.bin": b"not this model", "config.json": b"{}"}
    assert folder_contents(tiny) == tiny_in_s3


def test_second_call_reuses_the_cache_without_s3(s3, tiny_in_s3, tmp_path):
    first = download_s3_folder(URL, tmp_path)
    for item in s3.list_objects_v2(Bucket="bucket")["Contents"]:
        s3.delete_object(Bucket="bucket", Key=item["Key"])
    s3.delete_bucket(Bucket="bucket")
    # Any S3 call now fails (NoSuchBucket): a result proves S3 was not asked.
    with pytest.raises(S3Error):
        download_s3_folder("s3://bucket/models/not-cached", tmp_path)

    again = download_s3_folder(URL, tmp_path)
    assert again == first
    assert folder_contents(again) == tiny_in_s3
    # A trailing slash names the same folder, so it is served from the cache too.
    assert download_s3_folder(URL + "/", tmp_path) == first


def test_empty_prefix_is_an_error_naming_model_id(s3, tmp_path):
    s3.create_bucket(Bucket="bucket")
    s3.put_object(Bucket="bucket", Key="models/tiny-other/config.json", Body=b"{}")

    with pytest.raises(S3Error) as error:
        download_s3_folder(URL, tmp_path)

    message = str(error.value)
    assert "option.model_id" in message and URL in message
    assert "no objects" in message
    assert not s3_cache_path(URL, tmp_path).exists()


def test_missing_bucket_is_an_s3_error_not_a_traceback(s3, tmp_path):
    with pytest.raises(S3Error) as error:
        download_s3_folder("s3://no-such-bucket/models/tiny", tmp_path)

    message = str(error.value)
    assert "option.model_id" in message and "s3://no-such-bucket/models/tiny" in message
    assert "NoSuchBucket" in message
    assert error.value.__suppress_context__  # no chained botocore traceback
    assert not s3_cache_path("s3://no-such-bucket/models/tiny", tmp_path).exists()


def test_url_without_bucket_is_an_error(s3, tmp_path):
    with pytest.raises(S3Error, match="expected s3://bucket/prefix"):
        download_s3_folder("s3:///models/tiny", tmp_path)


def test_failed_download_publishes_nothing_and_is_redone(s3, tiny_in_s3, tmp_path):
    # The last key (listed in key order) cannot be read: archived objects refuse GetObject, so
    # the download fails after the model's other files already arrived.
    s3.put_object(
        Bucket="bucket", Key="models/tiny/zz-archived.bin", Body=b"x", StorageClass="GLACIER"
    )

    with pytest.raises(S3Error, match="InvalidObjectState"):
        download_s3_folder(URL, tmp_path)
    assert not s3_cache_path(URL, tmp_path).exists()
    assert leftovers(tmp_path) == []

    s3.delete_object(Bucket="bucket", Key="models/tiny/zz-archived.bin")
    folder = download_s3_folder(URL, tmp_path)
    assert folder_contents(folder) == tiny_in_s3


def test_local_write_error_is_an_s3_error_and_leaves_no_partial_folder(s3, tmp_path):
    s3.create_bucket(Bucket="bucket")
    s3.put_object(Bucket="bucket", Key="models/clash/a", Body=b"a file")
    s3.put_object(Bucket="bucket", Key="models/clash/a/b", Body=b"a file in a folder 'a'")
    url = "s3://bucket/models/clash"

    with pytest.raises(S3Error):
        download_s3_folder(url, tmp_path)
    assert not s3_cache_path(url, tmp_path).exists()
    assert leftovers(tmp_path) == []


def test_keys_cannot_write_outside_the_model_folder(s3, tiny_in_s3, tmp_path):
    cache_dir = tmp_path / "cache"
    s3.put_object(Bucket="bucket", Key="models/tiny/../../escape.txt", Body=b"escaped")

    try:
        folder = download_s3_folder(URL, cache_dir)
    except S3Error:
        folder = None
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert not [name for name in written if name.endswith("escape.txt")]
    if folder is not None:
        assert folder_contents(folder) == tiny_in_s3
