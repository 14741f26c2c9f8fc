"""The pooled head's mean: reduced-precision token states are summed into float32, and
float32 states pool to the same bits as the plain masked mean; on the CPU, numpy's mean
(the head's path for float32 states there) is torch's to float32 rounding, and an input's
mean is the same to the bit whatever its batch mates and padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.heads.chain import pool
from workers.heads.pooled import mean_rows


def _states() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 16)
    mask = torch.ones(2, 300, dtype=torch.int64)
    mask[1, 120:] = 0
    return hidden, mask


def test_a_bfloat16_mean_is_summed_and_answered_in_float32():
    hidden, mask = _states()
    states = hidden.to(torch.bfloat16)
    exact = (states.double() * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True)
    pooled = pool("mean", states, mask)
    assert pooled.dtype == torch.float32
    # A bfloat16 result keeps 8 bits of mantissa (about 4e-3 relative); float32 keeps 24.
    torch.testing.assert_close(pooled.double(), exact, rtol=1e-5, atol=1e-6)


def test_a_float32_mean_is_the_plain_masked_mean_to_the_bit():
    hidden, mask = _states()
    weights = mask[..., None].float()
    assert torch.equal(pool("mean", hidden, mask), (hidden * weights).sum(dim=1) / weights.sum(dim=1))


@pytest.mark.parametrize("normalize", [False, True])
def test_the_numpy_mean_on_the_cpu_is_torchs(normalize: bool):
    hidden, mask = _states()
    expected = pool("mean", hidden, mask)
    if normalize:
        expected = torch.nn.functional.normalize(expected, p=2, dim=1)
    pooled = mean_rows(hidden.numpy(), mask.numpy(), normalize)
    assert pooled.dtype == np.float32 and pooled.shape == (2, 16)
    np.testing.assert_allclose(pooled, expected.numpy(), rtol=1e-5, atol=1e-7)


def test_a_read_mask_of_int8_and_a_row_of_no_token_pool_as_in_torch():
    hidden, _ = _states()
    mask = torch.zeros(2, 300, dtype=torch.int8)
    mask[0, 3:40] = 1
    pooled = mean_rows(hidden.numpy(), mask.numpy(), normalize=True)
    np.testing.assert_allclose(pooled, torch.nn.functional.normalize(pool("mean", hidden, mask), dim=1).numpy(),
                               rtol=1e-5, atol=1e-7)
    assert not pooled[1].any()


def test_the_numpy_mean_of_an_input_does_not_depend_on_its_batch_mates_or_padding():
    rng = np.random.default_rng(0)
    states = rng.standard_normal((23, 384)).astype(np.float32)

    def pooled_in_a_batch(padded: int, mates: int) -> np.ndarray:
        hidden = rng.standard_normal((mates + 1, padded, 384)).astype(np.float32)
        mask = np.ones((mates + 1, padded), dtype=np.int64)
        hidden[0, :23], hidden[0, 23:], mask[0, 23:] = states, 0.0, 0
        return mean_rows(hidden, mask, normalize=True)[0]

    alone = pooled_in_a_batch(23, 0)
    for padded, mates in ((24, 1), (40, 3), (64, 7), (256, 31)):
        np.testing.assert_array_equal(pooled_in_a_batch(padded, mates), alone)
