"""A padding-free forward pass for ModernBERT encoders (gte-modernbert-base,
modernbert-embed-base): every linear layer runs on the real tokens of the batch only, and
padding exists only inside attention (`workers.engines.packing`), whose local layers keep
their window (a token attends to those at most `local_attention // 2` positions away)
and whose rotary positions count from each sequence's first token, so an input's states
do not depend on its batch mates.

transformers 5's `ModernBertModel` no longer unpads by itself (transformers 4's did, with
flash-attn): it runs padded, unless asked for flash-attn, whose integration unpads each
layer's attention only. This pass reuses the module's own layers (embeddings, norms,
fused query-key-value and output projections, gated MLP, rotary tables) and replaces only
attention, so results equal the module's forward up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engines import onednn
from workers.engines.packing import Packing, VarlenAttention, flash_varlen


def supports(model: nn.Module) -> bool:
    return type(model).__name__ == "ModernBertModel"


class PackedModernBert:
    def __init__(self, model: nn.Module) -> None:
        from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

        weight = model.embeddings.tok_embeddings.weight
        self._model = model
        self._rotate = apply_rotary_pos_emb
        self._heads = model.config.num_attention_heads
        self._window = model.config.sliding_window  # local_attention // 2, each side
        self.varlen: VarlenAttention | None = flash_varlen(weight.device, weight.dtype)
        self._buckets = onednn.uses_onednn(weight)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        """(n, L) ids and mask -> (n, L, hidden) token embeddings, zero at padding (the
        model has no token segments)."""
        model = self._model
        packing = Packing(attention_mask, self.varlen, self._buckets)
        x = packing.to_rows(model.embeddings(input_ids=packing.pack(input_ids)))
        positions = packing.positions()[None]
        rotary = {kind: model.rotary_emb(x, positions, kind) for kind in set(model.config.layer_types)}
        real = packing.real
        for layer in model.layers:
            qkv = layer.attn.Wqkv(layer.attn_norm(x)).view(len(x), 3, self._heads, -1)
            cos, sin = rotary[layer.attention_type]
            qkv[:real, 0], qkv[:real, 1] = self._rotate(qkv[:real, 0], qkv[:real, 1], cos[0], sin[0], unsqueeze_dim=1)
            window = self._window if layer.attention_type == "sliding_attention" else None
            x = x + layer.attn.Wo(packing.attend(qkv, window))
            x = x + layer.mlp(layer.mlp_norm(x))
        return packing.unpack(model.final_norm(x))


def classifier_logits(model: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """What `ModernBertForSequenceClassification` computes on its body's (n, L, hidden)
    states, zero at padding: its `classifier_pooling` (the first token's state, or the
    mean over the real tokens), its head, its classifier -> (n, labels)."""
    if model.config.classifier_pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = hidden.sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)
    return model.classifier(model.drop(model.head(pooled)))
