"""How the tests read the server's answers: an `embedding` field (floats or base64), an
answer without what is each answer's own (`unstamped`), and the JSON error shape every
error must have."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import requests


def decode_embedding(value: Any) -> np.ndarray:
    """An `embedding` field, float list or base64 of raw little-endian float32."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float32)
    return np.asarray(value, dtype=np.float32)


def unstamped(body: dict) -> dict:
    """An answer without what is each answer's own (an embeddings answer's `id` and
    `created`, as vLLM and infinity answer them), after checking it has them."""
    if "data" not in body:
        return body
    assert body["id"].startswith("embd-") and isinstance(body["created"], int), body
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def assert_error(response: requests.Response, status: int) -> dict[str, Any]:
    """`response` is the JSON error shape with `status`; return its `error` object."""
    assert response.status_code == status, (
        f"expected {status}, got {response.status_code}: {response.text[:500]}")
    assert response.headers.get("Content-Type", "").startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error
