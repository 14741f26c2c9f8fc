"""A padding-free forward pass for BERT-shaped encoders (BERT with absolute positions, such
as MiniLM; RoBERTa and XLM-RoBERTa, such as E5 and BGE-M3): every linear layer runs on
the real tokens of the batch only, and padding exists only inside attention. On a CPU,
where compute is proportional to the tokens processed, a batch of mixed lengths then
costs what its real tokens cost.

It reuses the loaded transformers module's weights (query, key and value fused into one
matrix), so results equal the module's own forward up to float rounding.

On a CPU in bfloat16 or float16 the linear layers run oneDNN kernels built for each
shape when first met (many milliseconds each, kept in a bounded cache): the count of
tokens is padded up to one of a few sizes (`token_bucket`), zero rows that cost a few
percent, so a server meets each shape once instead of building kernels on most passes
(their weights are prepacked: `workers.engines.onednn`).

Attention: by default scaled-dot-product attention over the padded (n, L) layout with a
key mask. On CUDA in float16 / bfloat16 with the `flash-attn` package installed, the
attention too runs on the packed tokens (flash-attn's variable-length kernel, sequences
delimited by cumulative lengths), so no padded tensor is ever built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from workers.engines import onednn

# flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
# (tokens, heads, head_dim) each -> (tokens, heads, head_dim).
VarlenAttention = Callable[..., torch.Tensor]


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


def token_bucket(tokens: int) -> int:
    """The row count a pass of `tokens` real tokens runs at in reduced precision on a
    CPU: a multiple of 8 up to 128, then sixteen sizes per doubling (at most 1/16 more
    rows), so 16384 tokens take about 130 shapes, within oneDNN's default cache of 1024
    kernels at three linear shapes per size."""
    if tokens <= 128:
        return -(-tokens // 8) * 8
    step = (1 << (tokens.bit_length() - 1)) // 16
    return -(-tokens // step) * step


def flash_varlen(device: torch.device, dtype: torch.dtype) -> VarlenAttention | None:
    """flash-attn's variable-length attention, where it can run: CUDA, half precision,
    the package installed."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


class PackedBert:
    def __init__(self, model: nn.Module) -> None:
        weight = model.embeddings.word_embeddings.weight
        self._embeddings = model.embeddings
        # Each row's real tokens come first, so a token's position is its index plus this.
        self._first_position = model.embeddings.padding_idx + 1 if _POSITIONS_AFTER_PAD[type(model).__name__] else 0
        self._layers = [_Layer(layer) for layer in model.encoder.layer]
        self._heads = model.config.num_attention_heads
        self.varlen: VarlenAttention | None = flash_varlen(weight.device, weight.dtype)
        self._buckets = onednn.uses_onednn(weight)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        """(n, L) ids, mask and segments -> (n, L, hidden) token embeddings, zero at padding."""
        n, length = input_ids.shape
        keep = attention_mask.bool()
        tokens = keep.view(-1).nonzero().squeeze(1)  # flat indices of real tokens
        positions = torch.arange(self._first_position, self._first_position + length,
                                 device=input_ids.device).expand(n, length).reshape(-1)[tokens]
        embeddings = self._embeddings
        # Summed in the module's order: in bfloat16 each sum rounds.
        x = (embeddings.word_embeddings(input_ids.view(-1)[tokens])
             + embeddings.token_type_embeddings(token_type_ids.view(-1)[tokens])
             + embeddings.position_embeddings(positions))
        x = embeddings.LayerNorm(x)
        real = len(tokens)
        if self._buckets:
            x = F.pad(x, (0, 0, 0, token_bucket(real) - real))
        if self.varlen is not None:
            lengths = attention_mask.sum(dim=1, dtype=torch.int32)
            bounds = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            attend = partial(self._attend_packed, bounds=bounds, longest=int(lengths.max()))
        else:
            attend = partial(self._attend_padded, tokens=tokens, keep=keep)
        for layer in self._layers:
            x = layer.attention_norm(layer.attention_out(attend(layer.qkv(x))) + x)
            x = layer.out_norm(layer.out(layer.activation(layer.intermediate(x))) + x)
        hidden = x.shape[-1]
        return x.new_zeros(n * length, hidden).index_copy_(0, tokens, x[:real]).view(n, length, hidden)

    def _attend_padded(self, qkv: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(tokens, 3 * hidden) -> (tokens, hidden): SDPA over the padded layout, keys masked."""
        n, length = keep.shape
        hidden = qkv.shape[-1] // 3
        real = len(tokens)  # the rows beyond are a bucket's padding: zero in, zero out
        padded = qkv.new_zeros(n * length, 3 * hidden).index_copy_(0, tokens, qkv[:real])
        q, k, v = padded.view(n, length, 3, self._heads, hidden // self._heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        attended = context.transpose(1, 2).reshape(n * length, hidden).index_select(0, tokens)
        return F.pad(attended, (0, 0, 0, len(qkv) - real))

    def _attend_packed(self, qkv: torch.Tensor, bounds: torch.Tensor, longest: int) -> torch.Tensor:
        """(tokens, 3 * hidden) -> (tokens, hidden): variable-length attention on the packed
        tokens; the sequences are consecutive (each row's real tokens come first), so
        `bounds` (cumulative lengths from 0) delimits them."""
        hidden = qkv.shape[-1] // 3
        q, k, v = qkv.view(-1, 3, self._heads, hidden // self._heads).unbind(1)
        assert self.varlen is not None
        return self.varlen(q, k, v, bounds, bounds, longest, longest).reshape(-1, hidden)
