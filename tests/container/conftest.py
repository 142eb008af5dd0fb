"""The real S3-compatible server fixtures (see s3_server.py) for every test in this folder."""

from .s3_server import s3, s3_server  # noqa: F401
