"""Prompts: where a model's come from (its models.toml entry, its folder's
sentence-transformers config, the built-in family table, found by the name its folder
declares), and the whole request path in one process with each model on its own engine
(tests/fast/inprocess.py's `ModelLauncher`), held to sentence-transformers'
`encode(..., prompt_name=...)` / `encode(..., prompt=...)` on the same tiny folders: a
prompt by name, as free text, by input type (OpenAI-style and Cohere's), the default one,
one left out of pooling, a decoder's instruction; `usage` counting the prompt's tokens;
what a model cannot honour refused with 422."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from infinity.config import ConfigError, ModelConfig
from infinity.folders.prompts import FAMILY_PROMPTS, family_of
from infinity.folders.resolve import packaged_model_folder, resolve_model
from tests.fast.inprocess import LoopedClient, ModelLauncher, serving_on_its_own_loop
from tests.support.tiny_models import save_tiny_prompted_encoder, save_tiny_qwen3_embedder

pytestmark = pytest.mark.timeout(120)

TEXTS = ["the quick brown fox", "a lazy dog while seven wizards quietly judge boxing matches", "7"]
PROMPTS = {"query": "query: ", "document": "passage: ", "classification": "classify this: "}
CONFIGURED_QUERY = "find: "  # models.toml's over the folder's
E5 = next(family for family in FAMILY_PROMPTS if family.family == "E5")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder of each prompt source: prompts and a default in its config; a query prompt
    its Pooling leaves out ("cls" then reads the first token after it); Qwen3-Embedding's
    layout; a folder of a family the built-in table knows, by its name, declaring none."""
    root = tmp_path_factory.mktemp("prompts")
    return {"prompted": save_tiny_prompted_encoder(root / "prompted", PROMPTS, "document", seed=1),
            "excluded": save_tiny_prompted_encoder(root / "excluded", {"query": "search query: "}, pooling="cls",
                                                   include_prompt=False, seed=2),
            "qwen3": save_tiny_qwen3_embedder(root / "qwen3", seed=3),
            "e5": save_tiny_prompted_encoder(root / "e5-small-v2", {}, seed=4)}


# Each model served, by name: its folder and what its models.toml entry adds.
MODELS = {"prompted": ("prompted", {}), "configured": ("prompted", {"prompts": {"query": CONFIGURED_QUERY}}),
          "excluded": ("excluded", {}), "qwen3": ("qwen3", {}), "e5": ("e5", {}),
          "e5-plain": ("e5", {"builtin_prompts": False})}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict:
    """sentence-transformers on each served model's folder, prompts given as models.toml gives them."""
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(str(folders[folder]), device="cpu", prompts=settings.get("prompts"))
            for name, (folder, settings) in MODELS.items()}


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> Iterator[LoopedClient]:
    """The models of `MODELS`, each on its own engine."""
    with serving_on_its_own_loop(ModelLauncher(), model=[
            ModelConfig(name=name, source=str(folders[folder]), engine="torch", **settings)
            for name, (folder, settings) in MODELS.items()]) as client:
        yield client


@pytest.mark.parametrize("model, fields, reference, prompt", [
    ("prompted", {"prompt_name": "query"}, {"prompt_name": "query"}, "query: "),
    ("prompted", {}, {}, "passage: "),  # the folder's default prompt
    ("prompted", {"prompt": "free text: "}, {"prompt": "free text: "}, "free text: "),
    ("prompted", {"prompt": ""}, {"prompt": ""}, ""),  # no prompt, over the default
    ("prompted", {"input_type": "search_query"}, {"prompt_name": "query"}, "query: "),
    ("prompted", {"input_type": "classification"}, {"prompt_name": "classification"}, "classify this: "),
    ("prompted", {"input_type": "clustering"}, {}, "passage: "),  # none of its own: the default
    ("configured", {"prompt_name": "query"}, {"prompt_name": "query"}, CONFIGURED_QUERY),
    ("configured", {"input_type": "document"}, {"prompt_name": "document"}, "passage: "),
    ("excluded", {"prompt_name": "query"}, {"prompt_name": "query"}, "search query: "),
    ("excluded", {}, {}, ""),
    ("qwen3", {"prompt_name": "query"}, {"prompt_name": "query"}, None),
    ("qwen3", {"input_type": "query"}, {"prompt_name": "query"}, None),
    ("qwen3", {"input_type": "document"}, {"prompt_name": "document"}, ""),
    ("e5", {"input_type": "query"}, {"prompt": "query: "}, "query: "),
    ("e5", {"input_type": "search_document"}, {"prompt": "passage: "}, "passage: "),
    ("e5-plain", {"input_type": "query"}, {}, ""),
])
def test_each_prompt_source_gives_sentence_transformers_vectors_and_usage(served, references, model, fields,
                                                                         reference, prompt):
    status, answer = served.ask("POST", "/v1/embeddings", {"model": model, "input": TEXTS, **fields})
    assert status == 200, answer
    got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
    expected = references[model].encode(TEXTS, **reference)
    np.testing.assert_allclose(got, expected, atol=2e-6)
    tokenizer, longest = references[model].tokenizer, references[model].max_seq_length
    prompt = references[model].prompts["query"] if prompt is None else prompt
    lengths = [len(tokenizer(prompt + text)["input_ids"]) for text in TEXTS]
    tokens = sum(min(length, longest) for length in lengths)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                               "truncated_inputs": sum(length > longest for length in lengths)}


def test_cohere_input_types_pick_the_prompt_too(served, references):
    status, answer = served.ask("POST", "/v2/embed", {"model": "prompted", "texts": TEXTS, "input_type": "search_query",
                                                 "embedding_types": ["float"]})
    assert status == 200, answer
    expected = references["prompted"].encode(TEXTS, prompt_name="query")
    np.testing.assert_allclose(answer["embeddings"]["float"], expected, atol=2e-6)


@pytest.mark.parametrize("fields, param, says", [
    ({"prompt_name": "nope"}, "prompt_name", "its prompts: classification, document, query"),
    ({"prompt_name": "query", "prompt": "q: "}, "prompt_name", "not both"),
    ({"input": [[5, 6, 7]], "prompt_name": "query"}, "prompt_name", "token ids"),
    ({"input_type": "passage"}, "input_type", ""),
])
def test_what_the_model_cannot_honour_is_refused(served, fields, param, says):
    status, answer = served.ask("POST", "/v1/embeddings", {"model": "prompted", "input": TEXTS, **fields})
    assert (status, answer["error"]["param"]) == (422, param), answer
    assert says in answer["error"]["message"]


def test_models_list_each_models_prompts(served):
    cards = {card["id"]: card for card in served.ask("GET", "/v1/models")[1]["data"]}
    assert (cards["prompted"]["prompts"], cards["prompted"]["default_prompt_name"]) == (PROMPTS, "document")
    assert cards["configured"]["prompts"] == {**PROMPTS, "query": CONFIGURED_QUERY}
    assert cards["e5"]["prompts"] == E5.prompts and cards["e5"]["default_prompt_name"] is None
    assert cards["e5-plain"]["prompts"] == {"query": "", "document": ""}  # what its folder declares


# --- where prompts come from, without a server -------------------------------------------------

def _front_matter(name: str) -> str:
    return f"---\ntags:\n- mteb\nmodel-index:\n- name: {name}\n  results: []\n---\n# {name}\n"


@pytest.mark.parametrize("path, card, family", [
    ("hub/models--intfloat--e5-small-v2/snapshots/0123abc", None, "E5"),  # a hub download
    ("models/embedder", "bge-small-en-v1.5", "BGE (English)"),  # a model card's name
    ("models/nomic-embed-text-v1.5", None, "Nomic Embed Text"),  # the folder's own name
    ("models/Qwen3-Embedding-0.6B", None, "Qwen3-Embedding"),
    ("models/snowflake-arctic-embed-m-v2.0", None, "Arctic Embed 2.0"),
    ("models/e5-small-v2-finetuned", None, None),  # a name matched whole only
    ("models/e5-small-v2", "SentenceTransformer based on intfloat/e5-small-v2", None),  # its card names it
    ("models/multilingual-e5-large-instruct", None, None),  # another prompt scheme
])
def test_a_family_is_known_by_the_name_its_folder_declares(tmp_path, path, card, family):
    root = tmp_path / path
    root.mkdir(parents=True)
    if card is not None:
        (root / "README.md").write_text(_front_matter(card))
    found = family_of(root)
    assert (found.family if found else None) == family


def _packaged_copy(root: Path) -> Path:
    """The packaged model's folder under another name (links to its files)."""
    root.mkdir(parents=True)
    for entry in packaged_model_folder().iterdir():
        (root / entry.name).symlink_to(entry)
    return root


def test_models_toml_prompts_layer_over_the_family_table_name_by_name(tmp_path):
    folder = str(_packaged_copy(tmp_path / "e5-base-v2"))
    assert resolve_model(ModelConfig(name="m", source=folder)).prompts == E5.prompts
    assert resolve_model(ModelConfig(name="m", source=folder, builtin_prompts=False)).prompts == {}
    spec = resolve_model(ModelConfig(name="m", source=folder, prompts={"query": "q: ", "topic": "topic: "},
                                     default_prompt_name="topic"))
    assert spec.prompts == {**E5.prompts, "query": "q: ", "topic": "topic: "}
    assert (spec.default_prompt_name, spec.prompt_for(None), spec.prompt_for("query")) == ("topic", "topic: ", "q: ")
    assert spec.prompt_for("document") == "passage: " and spec.pools_prompt


def test_prompts_a_model_cannot_have_stop_the_start(tmp_path):
    from tests.support.tiny_models import save_tiny_cross_encoder

    with pytest.raises(ConfigError, match="names none of its prompts"):
        resolve_model(ModelConfig(name="m", source=str(_packaged_copy(tmp_path / "model")),
                                  default_prompt_name="missing"))
    reranker = save_tiny_cross_encoder(tmp_path / "reranker")
    with pytest.raises(ConfigError, match="prompts apply to models that embed texts"):
        resolve_model(ModelConfig(name="m", source=str(reranker), kind="rerank", prompts={"query": "q: "}))


def test_the_api_document_writes_the_family_table_down():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    table = text[text.index("| family | names | prompts |"):].split("\n\n")[0]
    rows = {row.split(" | ")[0].removeprefix("| "): row for row in table.splitlines()[2:]}
    assert list(rows) == [family.family for family in FAMILY_PROMPTS]
    for family in FAMILY_PROMPTS:
        for name, prompt in family.prompts.items():
            spelled = prompt.replace("\n", "\\n")  # as the table of docs/api.md writes a newline
            assert f"`{name}`: " in rows[family.family] and (f"`{spelled}`" if prompt else f"`{name}`: none") in rows[
                family.family], (family, name)
