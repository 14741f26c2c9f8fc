"""The modules a model runs after its encoder (`ModelSpec.modules`: sentence-transformers'
Pooling, Dense, LayerNorm and Normalize, in its folder's order), run on the engine's token
states as sentence-transformers runs them: each step reads one feature (the token states
or the pooled vector) and writes one. Pooling follows sentence-transformers' formulas;
the steps after it compute in float32."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from infinity.shared.protocol import (SENTENCE_FEATURE, TOKEN_FEATURE, ChainStep, DenseStep, LayerNormStep, ModelSpec,
                                      NormalizeStep, PoolStep)


def pool(mode: str, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L, d) token states, (n, L) mask of the tokens read -> (n, d). The mask is the
    attention mask (right padding), less a prompt's tokens where the model leaves them out
    of pooling: "cls" takes the first token read, "lasttoken" the last, "max" the largest
    value of each dimension, "mean_sqrt_len_tokens" the sum over the square root of the
    count, "weightedmean" weights each token by its position (1 for the first token of
    the input, prompt included), as sentence-transformers' Pooling does."""
    if mode in ("mean", "mean_sqrt_len_tokens"):
        # Summed into float32: a reduced-precision sum would round every pooled vector to
        # 8 bits of mantissa (float32 states give the same bits as before).
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        total = (hidden * mask).sum(dim=1, dtype=torch.float32)
        count = mask.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)
        return total / (count if mode == "mean" else count.sqrt())
    if mode == "weightedmean":
        positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=torch.float32)
        weights = attention_mask.to(torch.float32) * positions
        total = (hidden.float() * weights.unsqueeze(-1)).sum(dim=1)
        return total / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
    if mode == "max":
        return hidden.masked_fill(~attention_mask.bool().unsqueeze(-1), float("-inf")).max(dim=1).values
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if mode == "cls":
        return hidden[rows, attention_mask.argmax(dim=1)]
    if mode == "lasttoken":
        return hidden[rows, attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(dim=1)]
    raise ValueError(f"unknown pooling {mode!r}")


def pooled_steps(spec: ModelSpec) -> tuple[ChainStep, ...]:
    """The model's steps after its encoder: its `modules`, or for a kind whose folder
    declares none (a hybrid model's dense vector) its pooling, then Normalize if it normalises."""
    if spec.modules:
        return spec.modules
    return (PoolStep(tuple(spec.pooling.split("+"))), *([NormalizeStep()] if spec.normalize else []))


def module_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A sentence-transformers module's weights (model.safetensors, else pytorch_model.bin),
    in float32."""
    if (folder / "model.safetensors").is_file():
        weights = load_file(str(folder / "model.safetensors"))
    else:
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {key: value.float() for key, value in weights.items()}


def linear_layer(weights: dict[str, torch.Tensor]) -> torch.nn.Linear:
    """The linear layer of a state dict (`weight`, and `bias` if any), for inference."""
    out_features, in_features = weights["weight"].shape
    layer = torch.nn.Linear(in_features, out_features, bias="bias" in weights)
    layer.load_state_dict(weights)
    return layer.eval()


def prefixed(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The weights under `prefix`, named without it."""
    return {key.removeprefix(prefix): value for key, value in weights.items() if key.startswith(prefix)}


class _Dense(torch.nn.Module):
    def __init__(self, step: DenseStep) -> None:
        super().__init__()
        weights = module_weights(Path(step.path))
        self.linear = linear_layer(prefixed(weights, "linear."))
        if (self.linear.in_features, self.linear.out_features, self.linear.bias is not None) != (
                step.in_features, step.out_features, step.bias):
            raise ValueError(f"{step.path}: the Dense module's weights are {self.linear.in_features}->"
                             f"{self.linear.out_features} (bias: {self.linear.bias is not None}); its config says "
                             f"{step.in_features}->{step.out_features} (bias: {step.bias})")
        self.activation = getattr(torch.nn, step.activation)()
        self.residual: torch.nn.Module | None = None
        if step.residual:
            projected = step.in_features != step.out_features
            self.residual = linear_layer(prefixed(weights, "residual.")) if projected else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


def _layer_norm(step: LayerNormStep) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(step.dimension)
    norm.load_state_dict(prefixed(module_weights(Path(step.path)), "norm."))
    return norm.eval()


class ModuleChain:
    """A model's steps after its encoder, built for an encoder of `width` (its hidden size);
    `dim`: the width of the vector it gives (its pooled feature, after every step)."""

    def __init__(self, steps: tuple[ChainStep, ...], width: int) -> None:
        self._steps = steps
        self._layers: list[torch.nn.Module | None] = []
        widths = {TOKEN_FEATURE: width}
        for step in steps:
            layer: torch.nn.Module | None = None
            if isinstance(step, PoolStep):
                widths[SENTENCE_FEATURE] = widths[TOKEN_FEATURE] * len(step.modes)
            elif isinstance(step, NormalizeStep):
                widths[step.target] = self._width(widths, step.source, None, step)
            elif isinstance(step, DenseStep):
                self._width(widths, step.source, step.in_features, step)
                layer, widths[step.target] = _Dense(step), step.out_features
            else:
                self._width(widths, SENTENCE_FEATURE, step.dimension, step)
                layer = _layer_norm(step)
            self._layers.append(layer)
        self.dim = self._width(widths, SENTENCE_FEATURE, None, "the model's output")

    @staticmethod
    def _width(widths: dict[str, int], feature: str, wanted: int | None, step: object) -> int:
        if feature not in widths:
            raise ValueError(f"{step} reads {feature}, which no module before it gives")
        if wanted is not None and widths[feature] != wanted:
            raise ValueError(f"{step} takes {wanted} values; {feature} has {widths[feature]}")
        return widths[feature]

    def __call__(self, states: torch.Tensor, mask: torch.Tensor, normalized: bool = True) -> torch.Tensor:
        """(n, L, d) token states and the (n, L) mask of the tokens read -> (n, dim) float32;
        `normalized` false: without the last step where it is a Normalize of the vector."""
        features = {TOKEN_FEATURE: states}
        steps = self._steps
        if not normalized and steps and steps[-1] == NormalizeStep():
            steps = steps[:-1]
        for step, layer in zip(steps, self._layers[:len(steps)], strict=True):
            if isinstance(step, PoolStep):
                pooled = [pool(mode, features[TOKEN_FEATURE], mask).float() for mode in step.modes]
                features[SENTENCE_FEATURE] = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)
            elif isinstance(step, NormalizeStep):
                features[step.target] = torch.nn.functional.normalize(features[step.source].float(), p=2, dim=-1)
            elif isinstance(step, DenseStep):
                assert layer is not None
                features[step.target] = layer.to(states.device)(features[step.source].float())
            else:
                assert layer is not None
                features[SENTENCE_FEATURE] = layer.to(states.device)(features[SENTENCE_FEATURE].float())
        return features[SENTENCE_FEATURE].float()
