"""What the padding-free forward passes (the encoders' `packed_bert`, `packed_modernbert`;
the decoders' `packed_decoder`) share: where a padded batch's real tokens lie, the moves
between the padded layout and the packed one (the real tokens, row after row), attention
over them (both ways, or causal; as many key-value heads as query heads, or fewer), and
the row counts a pass runs at in reduced precision on a CPU.

Such a pass runs every linear layer on the real tokens of the batch only; padding exists
only inside attention. On a CPU, where compute is proportional to the tokens processed, a
batch of mixed lengths then costs what its real tokens cost.

Attention: by default scaled-dot-product attention over the padded (n, L) layout under a
mask (keys at padding masked; a local layer's keys beyond its window too). On CUDA in
float16 / bfloat16 with the `flash-attn` package installed, attention too runs on the
packed tokens (flash-attn's variable-length kernel, sequences delimited by cumulative
lengths, a local layer's window given to the kernel), so no padded tensor is ever built.

On a CPU in bfloat16 or float16 the linear layers run oneDNN kernels built for each
shape when first met (many milliseconds each, kept in a bounded cache): the count of
tokens is padded up to one of a few sizes (`token_bucket`), zero rows that cost a few
percent, so a server meets each shape once instead of building kernels on most passes
(their weights are prepacked: `workers.engines.onednn`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch.nn import functional as F

# flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
# window_size=(left, right)): (tokens, heads, head_dim) each -> (tokens, heads, head_dim).
VarlenAttention = Callable[..., torch.Tensor]


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


def shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row of a batch of several, padded on the right, has
    in common, short of each row's last (whose state a decoder embedder pools)."""
    if len(input_ids) < 2:
        return 0
    same = (input_ids == input_ids[0]).all(dim=0)
    common = int(same.int().cumprod(0).sum())
    return min(common, int(attention_mask.sum(dim=1).min()) - 1)


class Packing:
    """One padded (n, L) batch's real tokens in the packed layout, padded at the end to
    `rows` (a `token_bucket` where `buckets`; zero rows, zero in and zero out of
    attention), and attention over them: `varlen`'s where given, else SDPA over the
    padded layout; `causal`: a token attends to those before it and itself only (a
    decoder's; the batch is padded on the right, so a sequence's tokens start at 0).

    `shared` (causal only, SDPA only): every row starts with the same `shared` tokens (an
    instruction prompt, `shared_prefix`), which only the first row computes: the others'
    are left out of the packed layout (of `real`), and their states, keys and values are
    the first row's, which causal attention makes equal to their own."""

    def __init__(self, attention_mask: torch.Tensor, varlen: VarlenAttention | None, buckets: bool,
                 causal: bool = False, shared: int = 0) -> None:
        assert not shared or (causal and varlen is None)
        self.keep = attention_mask.bool()
        self._causal = causal
        self._shared = shared
        computed = self.keep
        if shared:
            computed = computed.clone()
            computed[1:, :shared] = False
        self.tokens = computed.view(-1).nonzero().squeeze(1)  # flat indices of the tokens computed
        self.real = len(self.tokens)
        self.rows = token_bucket(self.real) if buckets else self.real
        self._varlen = varlen
        self._masks: dict[int | None, torch.Tensor] = {}
        if varlen is not None:
            # A row's real tokens are consecutive in the packed layout, so cumulative lengths
            # from 0 delimit the sequences.
            lengths = attention_mask.sum(dim=1, dtype=torch.int32)
            self._bounds = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            self._longest = int(lengths.max())

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(n, L) values of every token -> (real,) those of the real tokens."""
        return padded.reshape(-1)[self.tokens]

    def positions(self) -> torch.Tensor:
        """(real,) each real token's position in its sequence, from 0."""
        return self.pack(self.keep.cumsum(1) - 1)

    def to_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """(real, width) -> (rows, width): zero rows up to the bucket."""
        return F.pad(packed, (0, 0, 0, self.rows - self.real))

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(rows, ...) -> (n, L, ...), zero at padding."""
        n, length = self.keep.shape
        unpacked = packed.new_zeros(n * length, *packed.shape[1:]).index_copy_(0, self.tokens, packed[:self.real])
        unpacked = unpacked.view(n, length, *packed.shape[1:])
        if self._shared:
            unpacked[1:, :self._shared] = unpacked[0, :self._shared]
        return unpacked

    def attend(self, qkv: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """(rows, 3, heads, head_dim) queries, keys and values -> (rows, heads * head_dim):
        each token attends to the real tokens of its sequence; with `window`, only to those
        at most that many positions away (a local-attention layer's)."""
        if self._varlen is None:
            # One move to the padded layout for all three (not one each).
            return self._attend_padded(*self.unpack(qkv).unbind(2), mask=self._mask(window))
        return self.attend_heads(*qkv.unbind(1), window=window)

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
        """`attend` on (rows, heads, head_dim) queries and (rows, groups, head_dim) keys and
        values, where `groups` divides `heads` (grouped-query attention: each key-value head
        serves heads // groups query heads in turn)."""
        if self._varlen is None:
            return self._attend_padded(self.unpack(q), self.unpack(k), self.unpack(v), mask=self._mask(window))
        side = -1 if window is None else window  # flash-attn's "no limit"
        # Causal: no key after the query (flash-attn's window (-1, 0) is its causal mask).
        return self._varlen(q, k, v, self._bounds, self._bounds, self._longest, self._longest,
                            window_size=(side, 0 if self._causal else side)).reshape(len(q), -1)

    def _mask(self, window: int | None) -> torch.Tensor:
        """SDPA's mask for (n, heads, L, L) scores, True where a query attends a key; built
        once per window and pass."""
        if window not in self._masks:
            keys = self.keep[:, None, None, :]
            if self._causal:
                # Right padding: a real token's earlier keys are all real. A padding query
                # attends to the real tokens (its output is dropped).
                length = self.keep.shape[1]
                keys = keys & torch.ones(length, length, dtype=torch.bool, device=self.keep.device).tril()
            if window is None:
                self._masks[window] = keys
            else:
                index = torch.arange(self.keep.shape[1], device=self.keep.device)
                near = (index[:, None] - index[None, :]).abs() <= window
                # A padding query may attend to every key, so that no row of scores is all
                # masked (SDPA answers such a row with NaN); its output is dropped.
                self._masks[window] = keys & (near | ~self.keep[:, :, None])[:, None]
        return self._masks[window]

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SDPA over (n, L, heads or groups, head_dim) padded queries, keys and values ->
        (rows, heads * head_dim) packed."""
        n, length, heads, head_dim = q.shape
        context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=k.shape[2] != heads)
        return self.to_rows(context.transpose(1, 2).reshape(n * length, heads * head_dim).index_select(0, self.tokens))
