"""Audio a client sent, decoded in the preprocessing processes (never in the front end's
event loop nor beside the model): soundfile (libsndfile) with an allow-list of container
formats, the duration read from the header and checked before any sample is decoded,
then exactly transformers' own loading (`transformers.audio_utils.load_audio` with its
soundfile backend): float32 samples, channels averaged to mono, resampled with soxr's
high-quality filter to the rate the model takes. Every failure is the client's
(`InputError`, naming the item), and fails its own request only."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import soundfile
import soxr

from workers.preprocess import InputError

# Containers decoded (libsndfile's names); raw headerless data and exotic formats are refused.
FORMATS = ("WAV", "WAVEX", "RF64", "W64", "FLAC", "OGG", "MP3", "AIFF", "CAF")
MAX_CHANNELS = 32


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int
    max_seconds: float


def decode_audio(data: bytes, item: str, limits: AudioLimits, rate: int) -> np.ndarray:
    """The mono float32 waveform at `rate` samples per second of an audio file's bytes."""
    if len(data) > limits.max_bytes:
        raise InputError(f"{item} is larger than {limits.max_bytes} bytes, the most this server takes of one item")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            if sound.format not in FORMATS:
                raise InputError(f"{item} is audio in {sound.format} format, which this server does not read "
                                 f"({', '.join(FORMATS)})")
            source_rate, frames = sound.samplerate, sound.frames
            if not 0 < frames <= limits.max_seconds * source_rate:
                raise InputError(f"{item} holds no samples" if frames <= 0 else
                                 f"{item} is {frames / source_rate:.1f} s long, more than the {limits.max_seconds:g} s "
                                 "this server takes of one clip")
            if sound.channels > MAX_CHANNELS:
                raise InputError(f"{item} has {sound.channels} channels, more than the {MAX_CHANNELS} this server mixes")
            # At most the frames the header declares, whatever follows them.
            samples = sound.read(frames, dtype="float32", always_2d=True)
    except InputError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as exc:
        raise InputError(f"{item} could not be decoded as audio ({exc})") from None
    if len(samples) == 0:
        raise InputError(f"{item} holds no samples")
    waveform = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if source_rate != rate:
        count = math.ceil(len(waveform) * rate / source_rate)
        waveform = soxr.resample(waveform, source_rate, rate, quality="soxr_hq")
        waveform = np.pad(waveform, (0, max(0, count - len(waveform))))[:count]
    return np.ascontiguousarray(waveform, dtype=np.float32)
