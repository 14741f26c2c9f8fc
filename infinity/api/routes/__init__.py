"""The API's operations, one module per family of outputs: embeddings (OpenAI, Cohere),
scores (rerank, classify), vLLM's own (score, pooling, ping), the tokenizer's view
(tokenize, detokenize), the server's status (health, models), TEI's native routes
(`tei`: its dialect, sharing `/embed` and `/rerank` with Cohere), and SageMaker's one path
(`sagemaker`: every dialect's body on `/invocations`). Each module lists its
`ROUTES`; a new output kind is a new module here and its line below."""

from __future__ import annotations

from infinity.api.routes import embeddings, sagemaker, scores, status, tei, tokens, vllm
from infinity.api.routes.common import Route

ROUTES: list[Route] = [*embeddings.ROUTES, *scores.ROUTES, *vllm.ROUTES, *tokens.ROUTES, *status.ROUTES,
                       *tei.ROUTES, *sagemaker.ROUTES]

__all__ = ["ROUTES", "Route"]
