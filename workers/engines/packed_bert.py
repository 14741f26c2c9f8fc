"""A padding-free forward pass for BERT encoders (BertModel with absolute positions, such
as MiniLM): every linear layer runs on the real tokens of the batch only, and padding
exists only inside attention. On a CPU, where compute is proportional to the tokens
processed, a batch of mixed lengths then costs what its real tokens cost.

It reuses the loaded transformers module's weights (query, key and value fused into one
matrix), so results equal the module's own forward up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def supports(model: nn.Module) -> bool:
    config = model.config
    return (type(model).__name__ == "BertModel"
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
        self.attention_out = layer.attention.output.dense
        self.attention_norm = layer.attention.output.LayerNorm
        self.intermediate = layer.intermediate.dense
        self.activation = layer.intermediate.intermediate_act_fn
        self.out = layer.output.dense
        self.out_norm = layer.output.LayerNorm


class PackedBert:
    def __init__(self, model: nn.Module) -> None:
        self._embeddings = model.embeddings
        self._layers = [_Layer(layer) for layer in model.encoder.layer]
        self._heads = model.config.num_attention_heads

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        """(n, L) ids, mask and segments -> (n, L, hidden) token embeddings, zero at padding."""
        n, length = input_ids.shape
        keep = attention_mask.bool()
        tokens = keep.view(-1).nonzero().squeeze(1)  # flat indices of real tokens
        positions = torch.arange(length, device=input_ids.device).expand(n, length).reshape(-1)[tokens]
        embeddings = self._embeddings
        x = (embeddings.word_embeddings(input_ids.view(-1)[tokens])
             + embeddings.position_embeddings(positions)
             + embeddings.token_type_embeddings(token_type_ids.view(-1)[tokens]))
        x = embeddings.LayerNorm(x)
        key_mask = keep[:, None, None, :]
        hidden = x.shape[-1]
        head_dim = hidden // self._heads
        for layer in self._layers:
            qkv = x.new_zeros(n * length, 3 * hidden).index_copy_(0, tokens, layer.qkv(x))
            q, k, v = qkv.view(n, length, 3, self._heads, head_dim).permute(2, 0, 3, 1, 4)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            context = context.transpose(1, 2).reshape(n * length, hidden).index_select(0, tokens)
            x = layer.attention_norm(layer.attention_out(context) + x)
            x = layer.out_norm(layer.out(layer.activation(layer.intermediate(x))) + x)
        return x.new_zeros(n * length, hidden).index_copy_(0, tokens, x).view(n, length, hidden)
