"""Heads: what each model kind makes of an engine's raw output (`workers.heads.base.Head`),
and the model an inference process serves, an engine with its kind's head. A kind names
its head in the kinds table (`infinity.shared.kinds`); no engine changes for a new one."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import numpy as np
import torch

from infinity.shared.kinds import KINDS
from infinity.shared.protocol import QUERY_ROUTE, TOKEN_STATES, UNNORMALIZED, ModelSpec
from workers.engines import load_engine
from workers.engines.base import Engine, model_config
from workers.heads.base import Head
from workers.heads.multivector import read_rows


def load_head(spec: ModelSpec) -> Head:
    """The head of `spec`'s kind (imported lazily, like the engines)."""
    module_name, class_name = KINDS[spec.kind].head.split(":")
    return getattr(importlib.import_module(module_name), class_name)(spec, model_config(spec))


class LoadedModel:
    """A model as an inference process runs it: its engine's forward pass, then its head;
    `dtype`: what the engine computes in."""

    def __init__(self, engine: Engine, head: Head, dtype: str) -> None:
        self.engine = engine
        self.head = head
        self.dtype = dtype
        # The outputs of a head that computes several (`workers.heads.base.TypedHead`); () for one.
        self.vector_types: tuple[str, ...] = getattr(head, "vector_types", ())

    @torch.inference_mode()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                wide: bool = False, read_mask: np.ndarray | None = None, express: bool = False,
                vector_types: list[tuple[str, ...]] | None = None,
                ) -> (np.ndarray | list[np.ndarray] | list[dict[str, np.ndarray]]
                      | list[np.ndarray | dict[str, np.ndarray]]):
        """(n, longest) int64 ids, mask and token segments -> the head's output;
        `read_mask`: the tokens whose states the head reads, if not the attended ones;
        `wide`, `express`: the engine's pass to run it on; `vector_types`: the outputs each
        input wants of a head that computes several (None: all of them, as a warm-up runs),
        or, of a head of one output, `TOKEN_STATES` where an input wants its token states
        (every attended token's) instead of the head's output: a dict of them for that
        input, `UNNORMALIZED` where it wants its vector before the model's final Normalize
        (in its row of the head's output), and `QUERY_ROUTE` where a query takes a static query side (the head's
        `route_queries`), which no pass computes: its rows do not run through the engine."""
        routed = [row for row, types in enumerate(vector_types or []) if QUERY_ROUTE in types]
        if routed:
            return self._with_routed_queries(routed, input_ids, attention_mask, token_type_ids, wide, read_mask,
                                             express, vector_types or [])
        raw = self.engine.forward(input_ids, attention_mask, token_type_ids, wide=wide, express=express)
        mask = torch.from_numpy(attention_mask if read_mask is None else read_mask).to(raw.device)
        if not self.vector_types:
            outputs = self._vectors(raw, mask, vector_types or [])
            if not any(TOKEN_STATES in types for types in vector_types or []):
                return outputs
            states = read_rows(raw.float(), torch.from_numpy(attention_mask).to(raw.device))
            return [{TOKEN_STATES: states[row]} if TOKEN_STATES in types else outputs[row]
                    for row, types in enumerate(vector_types or [])]
        return self.head(raw, mask, input_ids, vector_types or [self.vector_types] * len(input_ids))

    def _vectors(self, raw: torch.Tensor, mask: torch.Tensor, vector_types: list[tuple[str, ...]]
                 ) -> np.ndarray | list[np.ndarray]:
        """The head's output of a batch, each row that wants `UNNORMALIZED` before the
        model's final Normalize (a `NormalizingHead`'s; the front end asks no other)."""
        rows = [row for row, types in enumerate(vector_types) if UNNORMALIZED in types]
        if not rows:
            return self.head(raw, mask)
        if len(rows) == len(raw):
            return self.head(raw, mask, normalized=False)
        outputs = self.head(raw, mask)
        outputs[rows] = self.head(raw[rows], mask[rows], normalized=False)
        return outputs

    def _with_routed_queries(self, routed: list[int], input_ids: np.ndarray, attention_mask: np.ndarray,
                             token_type_ids: np.ndarray, wide: bool, read_mask: np.ndarray | None, express: bool,
                             vector_types: list[tuple[str, ...]]) -> list[np.ndarray | dict[str, np.ndarray]]:
        """`forward` of a batch some of whose rows are queries of a static query side: those
        weighed by the head alone, the others through the engine."""
        queries = self.head.route_queries(input_ids[routed], attention_mask[routed])
        outputs: list[np.ndarray | dict[str, np.ndarray]] = [{QUERY_ROUTE: weights} for weights in queries]
        rows = [row for row in range(len(input_ids)) if row not in set(routed)]
        if rows:
            passed = self.forward(input_ids[rows], attention_mask[rows], token_type_ids[rows], wide=wide,
                                  read_mask=None if read_mask is None else read_mask[rows], express=express,
                                  vector_types=[vector_types[row] for row in rows])
            outputs += list(passed)
        order = routed + rows
        return [outputs[order.index(row)] for row in range(len(input_ids))]

    @torch.inference_mode()
    def forward_media(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray | list[np.ndarray]:
        """A batch of media items as their preprocessor collates them (arrays named as the
        model's inputs: an image's `pixel_values`, a clip's `input_features`, a page's
        pixels with its prompt's `input_ids` and `attention_mask`) -> the head's output (a
        two-tower model's image or audio vectors; a retrieval model's vectors per token,
        read where the attention mask is set)."""
        raw = self.engine.forward_media(arrays)
        mask = arrays.get("attention_mask")
        mask = torch.ones((len(raw), 1), dtype=torch.int64) if mask is None else torch.from_numpy(mask)
        return self.head(raw, mask.to(raw.device))


def load_model(spec: ModelSpec, threads: int) -> LoadedModel:
    """The spec's head, and the engine that gives it the raw output it needs; where
    `dtype = "auto"` chose bfloat16, in the precision its trial settles (workers/inference/precision.py)."""
    if spec.float32_engine is not None:
        from workers.inference.precision import load_by_trial

        return load_by_trial(spec, threads, load_model)
    return LoadedModel(load_engine(spec, threads, KINDS[spec.kind].outputs), load_head(spec), spec.dtype)
