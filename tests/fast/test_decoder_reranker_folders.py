"""Decoder rerankers' folders (issue 55): a plain Qwen3ForCausalLM folder named like
Qwen3-Reranker is read as a reranker with its model card's template and the ids of "yes"
and "no", on torch whatever engine `auto` would pick; one of another name stays refused;
sentence-transformers' CrossEncoder layout (Transformer and LogitScore) is read with its
chat template split around the pair; other engines are refused for it; its tokenizer
cuts a long document before the template's suffix, which it keeps whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from infinity.config import ConfigError, ModelConfig
from infinity.folders.causal_scores import QWEN3_RERANKER
from infinity.folders.resolve import resolve_model
from infinity.shared.protocol import Tokenize

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.support.tiny_models import save_tiny_causal_reranker, save_tiny_logit_score_reranker

    root = tmp_path_factory.mktemp("decoder-reranker-folders")
    plain = save_tiny_causal_reranker(root / "Qwen3-Reranker-0.6B")
    other = root / "my-qwen3-chat"
    shutil.copytree(plain, other)
    return {"plain": plain, "other": other, "logit-score": save_tiny_logit_score_reranker(root / "st-reranker")}


def _vocabulary_id(folder: Path, token: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token)


def test_plain_folder_named_like_qwen3_reranker_reranks(folders):
    spec = resolve_model(ModelConfig(name="m", source=str(folders["plain"])))
    assert (spec.kind, spec.engine) == ("rerank", "torch")
    assert spec.pair_template == QWEN3_RERANKER
    assert spec.score_tokens == (_vocabulary_id(folders["plain"], "yes"), _vocabulary_id(folders["plain"], "no"))


def test_causal_lm_of_another_name_is_refused(folders):
    with pytest.raises(ConfigError, match="not an embedder"):
        resolve_model(ModelConfig(name="m", source=str(folders["other"])))
    with pytest.raises(ConfigError, match="no known reranker"):
        resolve_model(ModelConfig(name="m", source=str(folders["other"]), kind="rerank"))


def test_logit_score_folder_is_read_with_its_chat_template(folders):
    from tests.support.tiny_models import CAUSAL_RERANKER_CHAT_TEMPLATE

    spec = resolve_model(ModelConfig(name="m", source=str(folders["logit-score"])))
    assert (spec.kind, spec.engine) == ("rerank", "torch")
    assert spec.score_tokens == (_vocabulary_id(folders["plain"], "yes"), _vocabulary_id(folders["plain"], "no"))
    template = spec.pair_template
    assert template is not None
    assert template.prefix.endswith("<Instruct>: Given a tiny query, find the tiny documents\n<Query>: ")
    assert template.infix == "\n<Document>: "
    # Jinja drops the template's last newline, as sentence-transformers renders it.
    assert template.suffix == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n"
    assert CAUSAL_RERANKER_CHAT_TEMPLATE.endswith("</think>\n\n")


@pytest.mark.parametrize("engine", ["onnx", "openvino", "ctranslate2"])
def test_other_engines_are_refused(folders, engine):
    with pytest.raises(ConfigError, match="only the torch engine"):
        resolve_model(ModelConfig(name="m", source=str(folders["plain"]), engine=engine))


def test_long_document_is_cut_before_the_kept_suffix(folders):
    from transformers import AutoTokenizer

    from workers.preprocess.text import ModelTokenizer

    spec = msgspec.structs.replace(resolve_model(ModelConfig(name="m", source=str(folders["plain"]))),
                                   max_length=300)
    tokenizer = ModelTokenizer(spec)
    document = "the quick brown fox jumps over a lazy dog " * 40  # the tiny BPE spends ~220 tokens on the template
    answer = tokenizer.tokenize(Tokenize(request_id=1, model="m", texts=[document, "a lazy dog"], query="quick fox"))
    assert answer.inputs.lengths[0] == 300 and answer.truncated == [0]
    assert answer.inputs.type_ids is None
    hf = AutoTokenizer.from_pretrained(str(folders["plain"]))
    template = spec.pair_template
    suffix = hf.encode(template.suffix, add_special_tokens=False)
    whole = hf.encode(template.body("quick fox", document), add_special_tokens=False)
    ids = np.frombuffer(answer.inputs.ids, dtype="<i4").tolist()
    assert ids[:300] == whole[:300 - len(suffix)] + suffix
    short = hf.encode(template.body("quick fox", "a lazy dog") + template.suffix, add_special_tokens=False)
    assert ids[300:] == short


def test_engine_scores_padding_free_as_padded(folders):
    """The torch engine runs the Qwen3 body padding-free; its scores of a mixed-length
    batch equal the padded forward's (right padding, the last attended token read)."""
    import torch

    from infinity.shared.kinds import KINDS
    from workers.engines.torch_engine import TorchEngine
    from workers.preprocess.text import ModelTokenizer, collate_tokens, token_items

    spec = resolve_model(ModelConfig(name="m", source=str(folders["plain"])))
    engine = TorchEngine(spec, 1, KINDS["rerank"].outputs)
    assert engine._packed is not None
    answer = ModelTokenizer(spec).tokenize(Tokenize(request_id=1, model="m", query="quick fox",
                                                    texts=["a lazy dog", "the quick brown fox jumps over " * 5]))
    batch = collate_tokens(token_items(answer.inputs)[1], engine.pad_id)
    assert len(set(answer.inputs.lengths)) == 2
    packed = engine.forward(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    ids, mask, types = (torch.from_numpy(batch[key]) for key in ("input_ids", "attention_mask", "token_type_ids"))
    with torch.inference_mode():
        padded = engine._padded(ids, mask, types)
    assert packed.shape == (2, 1)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
