"""A folder that ships its own modelling code (config.json's `auto_map`), as
jina-embeddings, nomic-embed and gte-v1.5 publish: served with `trust_remote_code = true`,
its vectors those of sentence-transformers loading the same code; refused at start
without it, and where the code it names in another hub repository cannot be fetched, by
the front end with a message rather than by a child with a traceback. Which engine serves
such a folder, and the messages: tests/fast/test_remote_code.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.server import ServerFailed
from tests.support.tiny_models import save_hf_tokenizer, save_tiny_bert, train_tokenizer

pytestmark = pytest.mark.timeout(300)

CONFIGURATION = '''
from transformers import BertConfig


class TinyRemoteConfig(BertConfig):
    model_type = "tinyremote"
'''
# Named as transformers' own class, as published code may be (jina's flash implementations
# are `BertModel` and `XLMRobertaModel`), so that a server choosing its padding-free
# forward by class name would skip the change below; tanh is not undone by normalising.
MODELING = '''
import torch
from transformers import BertModel as TransformersBertModel

from .configuration_tinyremote import TinyRemoteConfig


class BertModel(TransformersBertModel):
    config_class = TinyRemoteConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.last_hidden_state = torch.tanh(3 * output.last_hidden_state)
        return output
'''
AUTO_MAP = {"AutoConfig": "configuration_tinyremote.TinyRemoteConfig", "AutoModel": "modeling_tinyremote.BertModel"}
TEXTS = ["the quick brown fox", "a lazy dog", "seven wizards quietly judge boxing matches of jumbo sized vexing quartz",
         "7 numbers"]


def _save_tiny_remote(folder: Path, auto_map: dict[str, str]) -> Path:
    """A tiny BERT's weights and tokenizer under a config of its own model_type, whose
    `auto_map` names the code written beside them."""
    tokenizer = train_tokenizer()
    save_tiny_bert(folder, tokenizer=tokenizer)
    save_hf_tokenizer(tokenizer, folder, model_max_length=64)
    (folder / "configuration_tinyremote.py").write_text(CONFIGURATION)
    (folder / "modeling_tinyremote.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "tinyremote", "auto_map": auto_map}))
    return folder


@pytest.fixture(scope="module")
def remote_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_remote(tmp_path_factory.mktemp("remote-code") / "tinyremote", AUTO_MAP)


def _env(tmp_path: Path) -> dict[str, str]:
    # The copies transformers makes of the code go to this test's folder; nothing from the hub.
    return {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}


def test_trusted_code_is_served_as_sentence_transformers_runs_it(remote_folder: Path, tmp_path: Path,
                                                                 start_server) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(remote_folder), trust_remote_code=True, device="cpu").encode(TEXTS)
    config = f'[[models]]\nname = "tinyremote"\nsource = "{remote_folder}"\ntrust_remote_code = true\n'
    server = start_server(config=config, env=_env(tmp_path))
    got = np.array([item["embedding"] for item in server.embed(TEXTS, model="tinyremote").json()["data"]])
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert (cosine >= 0.99999).all(), cosine
    model = next(m for m in server.get("/v1/models").json()["data"] if m["id"] == "tinyremote")
    assert model["backend"] == "torch"


@pytest.mark.parametrize("trusted, auto_map, message", [
    (False, AUTO_MAP, "ships its own code"),
    # As nomic-embed-text-v1.5 names nomic-ai/nomic-bert-2048's code: offline, it cannot be fetched.
    (True, {"AutoConfig": "no-such-org/no-such-code--configuration_tinyremote.TinyRemoteConfig",
            "AutoModel": "no-such-org/no-such-code--modeling_tinyremote.BertModel"},
     "hub repository no-such-org/no-such-code"),
])
def test_a_start_that_cannot_run_the_code_is_refused_by_the_front_end(tmp_path: Path, start_server, trusted: bool,
                                                                      auto_map: dict[str, str], message: str) -> None:
    folder = _save_tiny_remote(tmp_path / "tinyremote", auto_map)
    config = (f'[[models]]\nname = "tinyremote"\nsource = "{folder}"\n'
              f'trust_remote_code = {str(trusted).lower()}\n')
    with pytest.raises(ServerFailed) as failed:
        start_server(config=config, env=_env(tmp_path))
    log = str(failed.value)
    assert "model 'tinyremote'" in log and message in log, log
    assert trusted or "set trust_remote_code = true" in log, log
    # No child started, none failed loading the model.
    assert "Traceback" not in log and "inference-cpu" not in log and "tokenizer-0" not in log, log
