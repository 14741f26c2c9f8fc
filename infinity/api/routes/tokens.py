"""The tokenizer's routes: `/tokenize` (each token of a text: its id, its spelling, its
characters in the text, whether it is special; how many, and the model's maximum length)
and `/detokenize` (token ids back to text). Each takes vLLM's body or TEI's and answers
in the shape of the one given. No model runs: its tokenizer answers, where
`EngineClient.look_up` says, within the bounds of the embedding routes (inputs per
request, characters per input)."""

from __future__ import annotations

from aiohttp import web

from infinity.api import openapi
from infinity.api.errors import APIError
from infinity.api.inputs import text_inputs, token_inputs
from infinity.api.prompts import with_prompt
from infinity.api.routes.common import ENGINE_CLIENT, MODEL_ERRORS, Route, max_items, served_model
from infinity.api.types.tokens import (DetokenizeAnswer, DetokenizeRequest, DetokenizeResponse, SimpleToken,
                                       TokenizeAnswer, TokenizeRequest, TokenizeResponse)
from infinity.client.engine_client import ModelInputs
from infinity.shared.kinds import kinds_with
from infinity.shared.protocol import TextTokens

# Models whose texts a tokenizer encodes (not a processor that frames them).
TOKENIZER_KINDS = kinds_with(lambda kind: not kind.text_by_processor)


async def tokenize(request: web.Request, body: TokenizeRequest) -> TokenizeAnswer:
    """Each text's tokens, whole (not cut to the model's length), after its prompt."""
    model = served_model(request, body.model, TOKENIZER_KINDS)
    if (body.prompt is None) == (body.inputs is None):
        raise APIError(422, "give prompt (vLLM's: one text) or inputs (TEI's: a text or a list of texts)",
                       param="prompt")
    if body.inputs is not None and body.return_token_strs:
        raise APIError(422, "return_token_strs is vLLM's (with prompt); TEI's answer (to inputs) holds each token's "
                            "text", param="return_token_strs")
    given = body.prompt if body.prompt is not None else body.inputs
    param = "prompt" if body.prompt is not None else "inputs"
    texts = text_inputs([given] if isinstance(given, str) else given, max_items(request), param).texts or []
    limit = model.spec.max_input_chars
    longer = next((i for i, text in enumerate(texts) if len(text) > limit), None)
    if longer is not None:
        raise APIError(422, f"{param}[{longer}] is longer than the {limit} characters model '{model.spec.name}' "
                            "reads of one input", param=param)
    inputs = with_prompt(model, ModelInputs(texts=texts), None, body.prompt_name, None)
    looked_up = await request.app[ENGINE_CLIENT].look_up(model, inputs, body.add_special_tokens)
    tokens = looked_up.tokens or []
    if body.prompt is not None:
        (text_tokens,) = tokens
        return TokenizeAnswer(TokenizeResponse(
            count=len(text_tokens.ids), max_model_len=model.spec.max_length, tokens=text_tokens.ids,
            token_strs=text_tokens.strings if body.return_token_strs else None))
    prompt = inputs.prompt_on(model.spec)
    return TokenizeAnswer([_simple_tokens(prompt + text, each) for text, each in zip(texts, tokens, strict=True)])


def _simple_tokens(text: str, tokens: TextTokens) -> list[SimpleToken]:
    """TEI's tokens of `text` (prompt included): a special token by its spelling, without
    a span; any other by the characters it stands for."""
    return [SimpleToken(id=token_id, text=spelling, special=True, start=None, stop=None) if special else
            SimpleToken(id=token_id, text=text[start:stop], special=False, start=start, stop=stop)
            for token_id, spelling, (start, stop), special in zip(tokens.ids, tokens.strings, tokens.offsets,
                                                                   tokens.special, strict=True)]


async def detokenize(request: web.Request, body: DetokenizeRequest) -> DetokenizeAnswer:
    """Each sequence of token ids as text."""
    model = served_model(request, body.model, TOKENIZER_KINDS)
    if (body.tokens is None) == (body.ids is None):
        raise APIError(422, "give tokens (vLLM's: one sequence) or ids (TEI's: a sequence or a list of them)",
                       param="tokens")
    if body.tokens is not None:
        inputs = ModelInputs(token_ids=[body.tokens])
    elif isinstance(body.ids, list) and body.ids:
        inputs = token_inputs(body.ids, max_items(request), "ids", "ids must be a list of token ids, or a list of "
                                                                  "lists of token ids")
    else:
        raise APIError(422, "ids must be a non-empty list of token ids, or of lists of token ids", param="ids")
    skip = body.skip_special_tokens if body.skip_special_tokens is not None else body.ids is not None
    texts = (await request.app[ENGINE_CLIENT].look_up(model, inputs, not skip)).texts or []
    return DetokenizeAnswer(DetokenizeResponse(texts[0]) if body.tokens is not None else texts)


ROUTES = [
    Route(openapi.Operation("post", "/tokenize", ("/v1/tokenize",),
                            "A text's tokens: ids, spellings, character offsets, special flags, count and the "
                            "model's maximum length (vLLM's or TEI's shape, as the body)", TokenizeRequest,
                            TokenizeAnswer, MODEL_ERRORS, TOKENIZER_KINDS), tokenize),
    Route(openapi.Operation("post", "/detokenize", ("/v1/detokenize",),
                            "Token ids back to text (vLLM's or TEI's shape, as the body)", DetokenizeRequest,
                            DetokenizeAnswer, MODEL_ERRORS, TOKENIZER_KINDS), detokenize),
]
