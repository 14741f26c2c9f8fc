"""`/tokenize` and `/detokenize` in one process (tests/fast/inprocess.py), in vLLM's shape
and TEI's, against the model's own tokenizer: ids, spellings, character offsets into the
text (prompt included), special flags, count and maximum length; token ids back to text;
a large lookup answered by a tokenizer process as a small one is in the front end; the
limits of the embedding routes; the routes and the prompt fields in the OpenAPI document."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer

from infinity.config import ModelConfig
from infinity.folders.resolve import packaged_model_folder
from tests.fast.inprocess import LoopedClient, serving_on_its_own_loop, tokenize_messages

pytestmark = pytest.mark.timeout(60)

TEXTS = ["Hello, wörld! Zürich café 東京 🙂", "seven wizards quietly judge boxing matches"]
PROMPTS = {"query": "query: ", "document": ""}
MAX_ITEMS = 4
MAX_CHARS = 3000


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


@pytest.fixture(scope="module")
def served() -> Iterator[LoopedClient]:
    """The packaged model as "m", and as "p" with prompts, "query" by default."""
    with serving_on_its_own_loop(model=[
            ModelConfig(name="m", engine="torch", max_input_chars=MAX_CHARS),
            ModelConfig(name="p", engine="torch", prompts=PROMPTS, default_prompt_name="query")],
            max_items_per_request=MAX_ITEMS) as client:
        yield client


def _tei_tokens(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[dict]:
    """TEI's tokens of `text`, from the tokenizer's own encoding."""
    encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return [{"id": i, "text": token, "special": True, "start": None, "stop": None} if special else
            {"id": i, "text": text[start:stop], "special": False, "start": start, "stop": stop}
            for i, token, (start, stop), special in zip(encoding.ids, encoding.tokens, encoding.offsets,
                                                         encoding.special_tokens_mask)]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_vllm_shape_counts_the_tokens_against_the_models_length(served, tokenizer, path):
    long_text = " ".join(["wizards"] * 300)  # never cut: the count says how far it overflows
    for text in (TEXTS[0], long_text):
        status, answer = served.ask("POST", path, {"model": "m", "prompt": text})
        ids = tokenizer.encode(text).ids
        assert (status, answer) == (200, {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None})
    status, answer = served.ask("POST", path, {"model": "m", "prompt": TEXTS[0], "add_special_tokens": False,
                                                 "return_token_strs": True})
    encoding = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert (answer["tokens"], answer["token_strs"]) == (encoding.ids, encoding.tokens)


def test_tei_shape_gives_each_tokens_characters_and_special_flag(served, tokenizer):
    status, answer = served.ask("POST", "/tokenize", {"model": "m", "inputs": TEXTS})
    assert (status, answer) == (200, [_tei_tokens(tokenizer, text) for text in TEXTS])
    assert [token["text"] for token in answer[0][1:5]] == ["Hello", ",", "wörld", "!"]  # as the text spells them
    status, alone = served.ask("POST", "/tokenize", {"model": "m", "inputs": TEXTS[1], "add_special_tokens": False})
    assert alone == [_tei_tokens(tokenizer, TEXTS[1], add_special_tokens=False)]


def test_tokens_follow_the_prompt_the_model_would_embed_with(served, tokenizer):
    """The default prompt, or the one named; TEI's offsets count from the prompt's start."""
    _, default = served.ask("POST", "/tokenize", {"model": "p", "prompt": TEXTS[1]})
    assert default["tokens"] == tokenizer.encode("query: " + TEXTS[1]).ids
    _, named = served.ask("POST", "/tokenize", {"model": "p", "inputs": [TEXTS[1]], "prompt_name": "document"})
    assert named == [_tei_tokens(tokenizer, TEXTS[1])]
    _, prompted = served.ask("POST", "/tokenize", {"model": "p", "inputs": [TEXTS[1]]})
    assert prompted == [_tei_tokens(tokenizer, "query: " + TEXTS[1])]
    _, embedded = served.ask("POST", "/v1/embeddings", {"model": "p", "input": [TEXTS[1]]})
    assert embedded["usage"]["prompt_tokens"] == default["count"]


def test_a_large_lookup_is_answered_by_a_tokenizer_process_as_a_small_one_here(served, tokenizer, monkeypatch):
    sent = tokenize_messages(monkeypatch)
    large = [TEXTS[0] * 80, TEXTS[1] * 60]  # past what the front end tokenizes itself
    _, answer = served.ask("POST", "/tokenize", {"model": "m", "inputs": large})
    assert [(message.lookup, message.texts) for message in sent] == [(True, large)]
    assert answer == [_tei_tokens(tokenizer, text) for text in large]
    _, small = served.ask("POST", "/tokenize", {"model": "m", "inputs": TEXTS})
    assert len(sent) == 1 and small == [_tei_tokens(tokenizer, text) for text in TEXTS]


def test_token_ids_come_back_as_text_in_either_shape(served, tokenizer):
    first, second = (tokenizer.encode(text).ids for text in TEXTS)
    status, answer = served.ask("POST", "/detokenize", {"model": "m", "tokens": first})
    assert (status, answer) == (200, {"prompt": tokenizer.decode(first, skip_special_tokens=False)})
    _, both = served.ask("POST", "/v1/detokenize", {"model": "m", "ids": [first, second]})
    assert both == tokenizer.decode_batch([first, second])  # TEI's: special tokens left out
    _, kept = served.ask("POST", "/detokenize", {"model": "m", "ids": second, "skip_special_tokens": False})
    assert kept == [tokenizer.decode(second, skip_special_tokens=False)] and kept[0].startswith("[CLS]")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "inputs": ["b"]}, "prompt"),
    ("/tokenize", {"inputs": ["b"], "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"inputs": ["b"] * (MAX_ITEMS + 1)}, "inputs"),
    ("/tokenize", {"inputs": ["b", "x" * (MAX_CHARS + 1)]}, "inputs"),
    ("/tokenize", {"inputs": ["b"], "prompt_name": "query"}, "prompt_name"),  # "m" has no prompts
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"ids": []}, "ids"),
    ("/detokenize", {"ids": ["a"]}, "ids"),
    ("/detokenize", {"ids": [[1], [1]] * MAX_ITEMS}, "ids"),
    ("/detokenize", {"tokens": [101, 2 ** 30]}, "input"),  # outside the vocabulary
])
def test_what_a_lookup_cannot_answer_is_refused(served, path, body, param):
    status, answer = served.ask("POST", path, {"model": "m", **body})
    assert (status, answer["error"]["param"]) == (422, param), answer


def test_the_openapi_document_has_the_routes_and_the_prompt_fields(served):
    _, document = served.ask("GET", "/openapi.json")
    paths, schemas = document["paths"], document["components"]["schemas"]
    for path, body, answer in (("tokenize", "TokenizeRequest", "TokenizeAnswer"),
                               ("detokenize", "DetokenizeRequest", "DetokenizeAnswer")):
        for prefix in ("/", "/v1/"):
            operation = paths[prefix + path]["post"]
            assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(body)
            assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer)
        assert len(schemas[answer]["anyOf"]) == 2  # vLLM's shape and TEI's
    assert {"prompt", "inputs", "prompt_name", "add_special_tokens", "return_token_strs"} <= set(
        schemas["TokenizeRequest"]["properties"])
    for body in ("EmbeddingRequest", "CohereEmbedRequest", "SparseEmbedRequest"):
        assert {"prompt", "prompt_name"} <= set(schemas[body]["properties"]), body
    assert "clustering" in str(schemas["EmbeddingRequest"]["properties"]["input_type"])
    assert {"prompts", "default_prompt_name"} <= set(schemas["ModelCard"]["properties"])
