"""A padding-free forward pass for BERT-shaped encoders (BERT with absolute positions, such
as MiniLM; RoBERTa and XLM-RoBERTa, such as E5 and BGE-M3): every linear layer runs on
the real tokens of the batch only, and padding exists only inside attention
(`workers.engines.packing`: the packed layout, attention over it, token buckets).

It reuses the loaded transformers module's weights (query, key and value fused into one
matrix), so results equal the module's own forward up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engines import onednn
from workers.engines.packing import Packing, VarlenAttention, flash_varlen


# The encoders whose layers are BERT's, and whether their positions count from the pad id
# (RoBERTa's do: a sequence's first token is at pad id + 1).
_POSITIONS_AFTER_PAD = {"BertModel": False, "RobertaModel": True, "XLMRobertaModel": True}


def supports(model: nn.Module) -> bool:
    config = model.config
    return (type(model).__name__ in _POSITIONS_AFTER_PAD
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(config, "is_decoder", False))


class _Layer:
    def __init__(self, layer: nn.Module) -> None:
        attention = layer.attention.self
        self.qkv = nn.Linear(attention.query.in_features, 3 * attention.query.out_features).to(
            device=attention.query.weight.device, dtype=attention.query.weight.dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attention.query.weight, attention.key.weight, attention.value.weight]))
            self.qkv.bias.copy_(torch.cat([attention.query.bias, attention.key.bias, attention.value.bias]))
        if onednn.uses_onednn(self.qkv.weight):
            onednn.prepack(self.qkv)  # the module's other linear layers are the engine's to prepack
        self.attention_out = layer.attention.output.dense
        self.attention_norm = layer.attention.output.LayerNorm
        self.intermediate = layer.intermediate.dense
        self.activation = layer.intermediate.intermediate_act_fn
        self.out = layer.output.dense
        self.out_norm = layer.output.LayerNorm


class PackedBert:
    def __init__(self, model: nn.Module) -> None:
        weight = model.embeddings.word_embeddings.weight
        self._embeddings = model.embeddings
        # A token's position id is its position in its sequence plus this.
        self._first_position = model.embeddings.padding_idx + 1 if _POSITIONS_AFTER_PAD[type(model).__name__] else 0
        self._layers = [_Layer(layer) for layer in model.encoder.layer]
        self._heads = model.config.num_attention_heads
        self.varlen: VarlenAttention | None = flash_varlen(weight.device, weight.dtype)
        self._buckets = onednn.uses_onednn(weight)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        """(n, L) ids, mask and segments -> (n, L, hidden) token embeddings, zero at padding."""
        packing = Packing(attention_mask, self.varlen, self._buckets)
        embeddings = self._embeddings
        # Summed in the module's order: in bfloat16 each sum rounds.
        x = (embeddings.word_embeddings(packing.pack(input_ids))
             + embeddings.token_type_embeddings(packing.pack(token_type_ids))
             + embeddings.position_embeddings(packing.positions() + self._first_position))
        x = packing.to_rows(embeddings.LayerNorm(x))
        for layer in self._layers:
            attended = packing.attend(layer.qkv(x).view(len(x), 3, self._heads, -1))
            x = layer.attention_norm(layer.attention_out(attended) + x)
            x = layer.out_norm(layer.out(layer.activation(layer.intermediate(x))) + x)
        return packing.unpack(x)
