"""The kinds table (infinity/shared/kinds.py) holds together: every kind names a head, a
folder reader and (if it takes a medium) a preprocessor that exist with the functions the
server calls; engines compute what the table says; every route serves some kind; and the
kinds table of docs/api.md names every kind with exactly the routes the server gives it."""

import importlib
import re
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from infinity.api.routes import ROUTES
from infinity.api.types.status import ModelCard
from infinity.config import EngineChoice, ModelKind
from infinity.shared.kinds import ENGINE_DTYPES, ENGINE_OUTPUTS, KINDS, TEXT, RawOutput, kinds_with, lacking
from workers.engines import ENGINES

ROOT = Path(__file__).resolve().parents[2]
CAPABILITIES = {"embed", "sparse", "rerank", "classify", "image_embed", "audio_embed"}


def _readme_kinds() -> dict[str, str]:
    """The kinds table of docs/api.md: kind -> what it serves."""
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("| kind | what it serves |"):].split("\n\n")[0]
    return {match[1]: match[2] for match in re.finditer(r"^\| `(\w+)` \| (.*) \|$", table, re.M)}


def test_the_readme_names_every_kind():
    assert list(_readme_kinds()) == list(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_the_readme_gives_each_kind_exactly_its_routes(kind):
    named = set(re.findall(r"`(/[\w/]+)`", _readme_kinds()[kind]))
    served = {route.operation.path for route in ROUTES if kind in route.operation.kinds}
    assert named == served


@pytest.mark.parametrize("kind", KINDS.values(), ids=lambda kind: kind.name)
def test_each_kind_names_parts_that_exist(kind):
    module, name = kind.head.split(":")
    assert callable(getattr(importlib.import_module(module), name))
    reader = importlib.import_module(kind.reader)
    assert callable(reader.detect) and callable(reader.settings)
    assert set(kind.capabilities) <= CAPABILITIES and TEXT in kind.outputs
    assert (kind.medium is None) == (kind.preprocessor is None)
    if kind.preprocessor is not None:
        preprocessor = importlib.import_module(kind.preprocessor)
        assert all(callable(getattr(preprocessor, part)) for part in ("Preprocessor", "example", "collate"))
    assert not kind.text_by_processor or kind.preprocessor is not None


def test_every_engine_is_in_every_table_and_torch_computes_everything():
    assert set(ENGINES) == set(ENGINE_OUTPUTS) == set(ENGINE_DTYPES)
    assert ENGINE_OUTPUTS["torch"] == frozenset(RawOutput)


def test_the_configuration_takes_the_tables_kinds_and_engines():
    assert get_args(ModelKind) == ("auto", *KINDS)
    assert get_args(EngineChoice) == (*ENGINE_OUTPUTS, "auto")
    card = msgspec.json.schema(ModelCard)["$defs"]["ModelCard"]
    assert sorted(card["properties"]["kind"]["enum"]) == sorted(KINDS)


def test_what_an_engine_lacks_names_the_medium_first():
    assert lacking("ctranslate2", KINDS["audio_text"].outputs) == [RawOutput.AUDIO_FEATURES, RawOutput.TEXT_FEATURES]
    assert lacking("onnx", KINDS["image_text"].outputs) == []
    assert lacking("torch", KINDS["image_multivector"].outputs) == []


@pytest.mark.parametrize("route", ROUTES, ids=lambda route: route.operation.path)
def test_every_model_route_serves_a_kind(route):
    bodies = route.operation.body if isinstance(route.operation.body, tuple) else (route.operation.body,)
    # A dialect whose bodies name no model (TEI's) finds its model by the kind it needs; a
    # path that forwards each body to its own operation has those operations' kinds.
    names_a_model = any(body is not None and "model" in body.__struct_fields__ for body in bodies)
    assert bool(route.operation.kinds) == (names_a_model and not route.operation.forwards)


def test_late_interaction_kinds_are_ragged():
    assert set(kinds_with(lambda kind: kind.late_interaction)) <= set(kinds_with(lambda kind: kind.ragged))
