"""A padding-free forward pass for the decoders served as embedders (Qwen3, as in
Qwen3-Embedding; Qwen2, as in gte-Qwen2): every linear layer runs on the real tokens of
the batch only, and padding exists only inside attention (`workers.engines.packing`),
which is causal and grouped-query, with rotary positions counted from each sequence's
first token, so an input's states do not depend on its batch mates. Leading tokens that
every input of a batch shares (queries behind one instruction prompt) are computed once:
with causal attention their states do not depend on what follows them.

It reuses the loaded transformers module's weights and layers (embeddings, RMS norms,
Qwen3's per-head query and key norms, rotary tables), with the query, key and value
projections fused into one matrix and the MLP's gate and up projections into another
(the modules' own weights become views of the fused ones, so no weight is held twice),
so results equal the module's forward up to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engines import onednn
from workers.engines.packing import Packing, VarlenAttention, flash_varlen, shared_prefix

_FAMILIES = ("Qwen2Model", "Qwen3Model")


def supports(model: nn.Module) -> bool:
    """A Qwen2 or Qwen3 body whose every layer attends to the whole sequence before each
    token (no sliding-window layer)."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (type(model).__name__ in _FAMILIES and not getattr(config, "use_sliding_window", False)
            and all(kind == "full_attention" for kind in layer_types))


def _fused(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing `linears` side by side; theirs become views of its
    weight (and bias), so the module that holds them keeps working on the same memory."""
    first = linears[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(linear.out_features for linear in linears), bias=has_bias,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([linear.bias for linear in linears]))
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight.data = fused.weight.data[start:end]
        if has_bias:
            linear.bias.data = fused.bias.data[start:end]
        start = end
    if onednn.uses_onednn(fused.weight):
        onednn.prepack(fused)  # the module's other linear layers are the engine's to prepack
    return fused


class _Layer:
    def __init__(self, layer: nn.Module) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.qkv = _fused([attention.q_proj, attention.k_proj, attention.v_proj])
        self.query_width, self.key_width = attention.q_proj.out_features, attention.k_proj.out_features
        # Qwen3 normalises each head's queries and keys (before the rotation); Qwen2 does not.
        self.query_norm = getattr(attention, "q_norm", None)
        self.key_norm = getattr(attention, "k_norm", None)
        self.attention_out = attention.o_proj
        self.mlp_norm = layer.post_attention_layernorm
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        self.activation = mlp.act_fn
        self.down = mlp.down_proj


class PackedDecoder:
    def __init__(self, model: nn.Module) -> None:
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        weight = model.embed_tokens.weight
        self._model = model
        self._rotate = apply_rotary_pos_emb  # Qwen2's is the same function
        self._layers = [_Layer(layer) for layer in model.layers]
        self._head_dim = model.layers[0].self_attn.head_dim
        self.varlen: VarlenAttention | None = flash_varlen(weight.device, weight.dtype)
        self._buckets = onednn.uses_onednn(weight)
        # Whether a batch's common leading tokens are computed once (`Packing`'s `shared`),
        # on the SDPA path.
        self.shares_prefix = True

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        """(n, L) ids and mask, padded on the right -> (n, L, hidden) token states, zero at
        padding (the model has no token segments)."""
        model = self._model
        shared = shared_prefix(input_ids, attention_mask) if self.shares_prefix and self.varlen is None else 0
        packing = Packing(attention_mask, self.varlen, self._buckets, causal=True, shared=shared)
        x = packing.to_rows(model.embed_tokens(packing.pack(input_ids)))
        # Zero rows of rotation beyond the real tokens: the bucket's zero rows stay zero.
        cos, sin = (packing.to_rows(table[0]) for table in model.rotary_emb(x, packing.positions()[None]))
        head_dim = self._head_dim
        for layer in self._layers:
            q, k, v = layer.qkv(layer.input_norm(x)).split(
                [layer.query_width, layer.key_width, layer.key_width], dim=-1)
            q, k, v = (part.view(len(x), -1, head_dim) for part in (q, k, v))
            if layer.query_norm is not None:
                q, k = layer.query_norm(q), layer.key_norm(k)
            q, k = self._rotate(q, k, cos, sin, unsqueeze_dim=1)
            x = x + layer.attention_out(packing.attend_heads(q, k, v))
            gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + layer.down(layer.activation(gate) * up)
        return packing.unpack(model.norm(x))
