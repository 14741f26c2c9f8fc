"""The torch engine's padding-free BERT forward against the transformers module's own."""

import json

import numpy as np
import torch

from infinity.config import ModelConfig
from tests.tiny_models import save_tiny_bert
from workers.engines import load_engine
from workers.models import resolve_model


def test_packed_bert_equals_the_padded_module_forward(tmp_path):
    folder = save_tiny_bert(tmp_path / "tiny")
    engine = load_engine(resolve_model(ModelConfig(name="tiny", source=str(folder), pooling="mean", engine="torch")),
                         threads=1)
    assert engine._packed is not None  # BertModel takes the padding-free path
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    lengths = [3, 17, 64, 1, 40]
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(5, vocab_size, length)
        mask[row, :length] = 1
    types = np.zeros_like(ids)
    types[:, 2:] = mask[:, 2:]  # a second segment, as in query-document pairs
    tensors = [torch.from_numpy(a) for a in (ids, mask, types)]
    packed = engine._packed(*tensors)
    with torch.inference_mode():
        padded = engine._padded(*tensors)
    keep = torch.from_numpy(mask).bool()
    torch.testing.assert_close(packed[keep], padded[keep], atol=1e-5, rtol=1e-4)
    assert (packed[~keep] == 0).all()
