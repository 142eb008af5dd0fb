"""SageMaker's `X-Amzn-SageMaker-Custom-Attributes` header: the one way a client of
`InvokeEndpoint` passes its own metadata through SageMaker (which strips other headers).

SageMaker treats the value as opaque (up to 1024 visible ASCII characters). DJL Serving reads
it as `key1=value1;key2=value2` (RequestParser.java): split at `;`, each piece at its first
`=`, both sides trimmed, pieces without `=` skipped; so does lmserve. Only `;` separates: a
value may hold commas (`ids=1,2,3`). A value in another format is not an error: it parses to
fewer (or no) pairs, and the header itself still reaches the handler unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"


def parse_custom_attributes(value: str) -> dict[str, str]:
    attributes: dict[str, str] = {}
    for piece in value.split(";"):
        key, has_value, text = piece.partition("=")
        if has_value and key.strip():
            attributes[key.strip()] = text.strip()
    return attributes


def custom_attributes_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The parsed attributes of a request's headers (names compared case-insensitively)."""
    wanted = CUSTOM_ATTRIBUTES_HEADER.lower()
    value = next((v for k, v in headers.items() if k.lower() == wanted), None)
    return parse_custom_attributes(value) if value else {}
