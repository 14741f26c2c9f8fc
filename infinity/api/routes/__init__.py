"""The API's operations, one module per family of outputs: embeddings (OpenAI, Cohere),
scores (rerank, classify), vLLM's own (score, ping), the tokenizer's view (tokenize,
detokenize), the server's status (health, models). Each module lists its `ROUTES`; a new output kind is a new module here
and its line below."""

from __future__ import annotations

from infinity.api.routes import embeddings, scores, status, tokens, vllm
from infinity.api.routes.common import Route

ROUTES: list[Route] = [*embeddings.ROUTES, *scores.ROUTES, *vllm.ROUTES, *tokens.ROUTES, *status.ROUTES]

__all__ = ["ROUTES", "Route"]
