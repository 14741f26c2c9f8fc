"""Decoding client audio: every container, encoding, rate and channel layout the tests
generate gives what transformers' own `load_audio` (soundfile backend) gives at the
model's rate, and every kind of bad clip or oversize item is a client error naming the
item, refused before its samples are decoded where the header tells."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from workers.preprocess.audio_decoding import AudioLimits, decode_audio
from workers.preprocess import InputError

LIMITS = AudioLimits(max_bytes=1 << 22, max_seconds=10.0)
RATE = 16000


def _encoded(seconds: float, rate: int, channels: int, fmt: str, subtype: str | None = None) -> bytes:
    rng = np.random.default_rng(channels + rate)
    samples = (0.2 * rng.standard_normal((int(seconds * rate), channels))).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


CASES = [(0.5, RATE, 1, "WAV", "PCM_16"), (0.5, RATE, 1, "WAV", "FLOAT"), (0.3, 48000, 2, "WAV", "PCM_24"),
         (0.4, 44100, 2, "FLAC", None), (0.6, 8000, 1, "OGG", "VORBIS"), (0.5, 22050, 1, "MP3", None),
         (0.2, RATE, 6, "WAV", "PCM_16")]


@pytest.mark.parametrize("seconds, rate, channels, fmt, subtype", CASES)
def test_decoding_matches_transformers_loading(seconds, rate, channels, fmt, subtype):
    from transformers.audio_utils import load_audio

    data = _encoded(seconds, rate, channels, fmt, subtype)
    waveform = decode_audio(data, "input[0]", LIMITS, RATE)
    assert waveform.dtype == np.float32 and waveform.ndim == 1
    expected = load_audio(_as_uri(data), sampling_rate=RATE, backend="soundfile")
    np.testing.assert_array_equal(waveform, expected)


def _as_uri(data: bytes) -> str:
    import base64

    return "data:audio/wav;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("data, reason", [
    (b"", "could not be decoded as audio"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 40, "could not be decoded as audio"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "could not be decoded as audio"),
    (_encoded(11, 8000, 1, "FLAC"), "11.0 s long, more than the 10 s"),
    (_encoded(0.1, 8000, 1, "AU"), "in AU format"),
    (_encoded(0.1, 8000, 1, "WAV") + b"\x00" * (1 << 22), "larger than"),
])
def test_bad_clips_are_the_clients_errors(data, reason):
    with pytest.raises(InputError, match=reason) as caught:
        decode_audio(data, "input[3]", LIMITS, RATE)
    assert "input[3]" in str(caught.value)


def test_a_header_that_declares_too_long_a_clip_is_refused_before_decoding(monkeypatch):
    """Only the header is read: the samples of a clip over the limit are never decoded."""
    data = _encoded(11, 8000, 1, "WAV")
    read = []
    monkeypatch.setattr(soundfile.SoundFile, "read", lambda self, *a, **k: read.append(1))
    with pytest.raises(InputError, match="more than the 10 s"):
        decode_audio(data, "input[0]", LIMITS, RATE)
    assert read == []
