"""Bodies of the tokenizer's routes, `/tokenize` and `/detokenize`: one request type each
that takes vLLM's body or TEI's, and the answer in each one's shape."""

from __future__ import annotations

from typing import Annotated, Any, NewType

from msgspec import Meta, Struct

from infinity.api.types.common import _TOKEN_ID

TokenId = Annotated[int, Meta(ge=0, le=2 ** 31 - 1)]


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's body (`prompt`: one text; `return_token_strs`) or TEI's (`inputs`: a text or
    a list of them; `prompt_name`, which vLLM's takes too), with `add_special_tokens` in
    both; answered in the shape of the one given. Texts are tokenized whole, after the
    model's prompt (`prompt_name`'s, else its default one, as it embeds them)."""

    model: str | None = None
    prompt: Annotated[str, Meta(description="vLLM's: the text to tokenize")] | None = None
    inputs: Annotated[str | Annotated[list[str], Meta(min_length=1)],
                      Meta(description="TEI's: a text, or a list of texts")] | None = None
    add_special_tokens: bool = True
    return_token_strs: Annotated[bool, Meta(description="vLLM's: answer each token as the vocabulary spells it "
                                                        "too (TEI's answer always has it)")] = False
    prompt_name: Annotated[str, Meta(description="The model's prompt of this name (its list is on /v1/models) "
                                                 "before each text")] | None = None


class TokenizeResponse(Struct, kw_only=True):
    """vLLM's answer: the text's token ids, how many, the model's maximum length and, if
    asked, each token as the vocabulary spells it."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class SimpleToken(Struct, kw_only=True):
    """TEI's token: its id; its text (the characters it stands for, or the special token's
    own spelling); whether it is special; its span of characters [start, stop) in the text
    tokenized (the prompt, then the input), none for a special token the tokenizer adds."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


# `/tokenize`'s answer: vLLM's shape, or TEI's (per text, its tokens).
TokenizeAnswer = NewType("TokenizeAnswer", TokenizeResponse | list[list[SimpleToken]])


TokenIds = Annotated[Any, Meta(
    description="TEI's: a list of token ids, or a list of lists of them",
    extra_json_schema={"anyOf": [{"type": "array", "items": _TOKEN_ID, "minItems": 1},
                                 {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                                  "minItems": 1}]})]


class DetokenizeRequest(Struct, kw_only=True):
    """vLLM's body (`tokens`: one sequence) or TEI's (`ids`: a sequence or a list of them);
    answered in the shape of the one given."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Meta(description="vLLM's: the token ids of one text")] | None = None
    ids: TokenIds | None = None
    skip_special_tokens: Annotated[bool, Meta(description="Leave special tokens out of the text; default: true "
                                                          "with ids (TEI's), false with tokens (vLLM's)")] | None = None


class DetokenizeResponse(Struct):
    """vLLM's answer: the text."""

    prompt: str


# `/detokenize`'s answer: vLLM's shape, or TEI's (a text per sequence).
DetokenizeAnswer = NewType("DetokenizeAnswer", DetokenizeResponse | list[str])
