"""Audio clips made ready for a two-tower model's audio tower (CLAP), in the tokenizer
processes: each item decoded (`workers.preprocess.audio_decoding`: a data: URI or fetched bytes, with the
server's limits) at the rate the model's feature extractor takes, cut to its window
(the first `max_length_s` seconds), and turned into spectrograms by the folder's own
feature extractor: its `input_features`, with `is_longer` false for every clip.

Cutting first keeps a clip's vector the same from request to request: the feature
extractor crops a longer clip at random (and its `fusion` mode marks a random clip of a
batch as long). A clip costs the batcher, and counts in `usage`, its spectrogram's frames
(every clip is padded to the window, so all cost the same)."""

from __future__ import annotations

import numpy as np

from infinity.shared import protocol
from infinity.shared.protocol import ModelSpec
from workers.preprocess.audio_decoding import AudioLimits, decode_audio
from workers.preprocess.media import item_bytes, stack_items


class Preprocessor:
    def __init__(self, spec: ModelSpec, args: protocol.WorkerArgs) -> None:
        self._extractor = _feature_extractor(spec)
        self._rate = int(self._extractor.sampling_rate)
        self._window = int(self._extractor.nb_max_samples)
        self._limits = AudioLimits(args.max_audio_bytes, args.max_audio_seconds)

    def prepare(self, request: protocol.Tokenize) -> protocol.Tokenized:
        """The answer to a `Tokenize` of audio clips: their spectrograms, and their frames as lengths."""
        clips = [decode_audio(item_bytes(item, f"input[{i}]", self._limits.max_bytes, "audio"), f"input[{i}]",
                              self._limits, self._rate)[:self._window]
                 for i, item in enumerate(request.media or [])]
        return protocol.Tokenized(request.request_id, _inputs(_spectrograms(self._extractor, clips)))


def example(spec: ModelSpec, count: int) -> protocol.FeatureInputs:
    """`count` silent clips' spectrograms as the audio tower takes them; each costs its frames."""
    extractor = _feature_extractor(spec)
    return _inputs(_spectrograms(extractor, [np.zeros(int(extractor.nb_max_samples), dtype=np.float32)] * count))


collate = stack_items


def _inputs(features: np.ndarray) -> protocol.FeatureInputs:
    """The audio tower's inputs of clips' spectrograms: no clip is longer than the window,
    so none is marked longer (which would fuse a random crop of it)."""
    longer = np.zeros((len(features), 1), dtype=bool)
    return protocol.FeatureInputs([protocol.ArrayPart.of("input_features", features),
                                   protocol.ArrayPart.of("is_longer", longer)], [features.shape[2]] * len(features))


def _feature_extractor(spec: ModelSpec):  # noqa: ANN202 (transformers stays lazy)
    # The feature extractor alone: the folder's processor would hand it the tokenizer's
    # saved max_length too, which cuts every clip to a frame or two.
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)


def _spectrograms(extractor, clips: list[np.ndarray]) -> np.ndarray:  # noqa: ANN001
    """(clips, channels, frames, mel bins) float32: no clip is longer than the window, so
    nothing is cropped at random (and the `is_longer` flags it returns are not used)."""
    features = extractor(clips, sampling_rate=extractor.sampling_rate, return_tensors="np")["input_features"]
    return np.ascontiguousarray(features, dtype=np.float32)
