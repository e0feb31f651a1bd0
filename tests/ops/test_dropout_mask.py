"""Dropout's counter-based masks (the fused step's ``_core.dropout_forward`` / ``_backward``):
the exact bits of an independent NumPy Philox-4x32-10 (itself checked on Random123's published
known answers), a keep fraction within a binomial bound, the p = 0 and p = 1 edges, rows of a
split batch masked as the same rows of the whole, and bad p refused."""
import numpy as np
import pytest

import mgpu
import reference as ref
from mgpu import _core, nn


def test_reference_philox_gives_random123_known_answers():
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
              (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        got = tuple(int(w) for w in ref.philox4x32_10(counter, key))
        assert got == want, f"counter {counter}: {[hex(w) for w in got]}"


def forward(x, p, seed, stream=0, first_row=0, device=None):
    t = mgpu.array(x, device=device)
    return mgpu.Tensor(_core.dropout_forward(t._t, p, seed, stream, first_row)).numpy()


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 2, 3, 3), (4, 16)])
@pytest.mark.parametrize("seed,stream,first_row", [(0, 0, 0), (2**40 + 12345, 3, 17),
                                                   (2**64 - 1, 2**32 - 1, 2**31)])
def test_masks_are_the_reference_bits_on_every_device(device, rng, shape, seed, stream,
                                                      first_row):
    x = rng.standard_normal(shape).astype(np.float32)
    p = 0.3
    mask = ref.dropout_mask(shape, p, seed, stream, first_row)
    y = forward(x, p, seed, stream, first_row, device)
    assert np.array_equal(y, x * mask), f"{device}: forward differs from x * the reference mask"
    dy = rng.standard_normal(shape).astype(np.float32)
    dx = mgpu.Tensor(_core.dropout_backward(mgpu.array(dy, device=device)._t, p, seed, stream,
                                            first_row)).numpy()
    assert np.array_equal(dx, dy * mask), f"{device}: backward differs from dy * the mask"


def test_kept_elements_are_scaled_by_the_float32_reciprocal():
    # 0.45 and 0.47: the float32 reciprocal of float32(1 - p) differs from 1 / (1 - p) rounded.
    for p in (0.1, 1 / 3, 0.45, 0.47, 0.5, 0.9):
        y = forward(np.ones((8, 64), np.float32), p, 7)
        kept = y[y != 0]
        assert kept.size > 0
        assert np.all(kept == np.float32(1.0) / np.float32(1.0 - p)), p


@pytest.mark.parametrize("p", [0.1, 0.5, 0.85])
def test_keep_fraction_is_within_a_binomial_bound(p):
    n = 64 * 1000
    y = forward(np.ones((64, 1000), np.float32), p, 2024)
    kept = np.count_nonzero(y)
    sd = np.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) < 5 * sd, f"p={p}: kept {kept} of {n}"
    # Neighbouring elements, rows and streams are not the same draws.
    other = forward(np.ones((64, 1000), np.float32), p, 2024, stream=1)
    agree = np.count_nonzero((y != 0) == (other != 0))
    q = p * p + (1 - p) * (1 - p)
    assert abs(agree - n * q) < 5 * np.sqrt(n * q * (1 - q))


def test_p_zero_is_the_identity_and_p_one_gives_zeros(device, rng):
    x = rng.standard_normal((6, 5)).astype(np.float32)
    assert np.array_equal(forward(x, 0.0, 9, device=device), x)
    y = forward(x, 1.0, 9, device=device)
    assert np.array_equal(y, np.zeros_like(x)) and not np.signbit(y[x > 0]).any()


def test_rows_of_a_split_batch_get_the_rows_of_the_whole(rng):
    x = rng.standard_normal((11, 3, 5)).astype(np.float32)
    whole = forward(x, 0.4, 31, stream=2)
    for a, b in ((0, 4), (4, 5), (5, 11)):
        assert np.array_equal(forward(x[a:b], 0.4, 31, stream=2, first_row=a), whole[a:b])
    assert not np.array_equal(forward(x[4:8], 0.4, 31, stream=2), whole[4:8])


def test_the_seed_and_the_stream_change_the_masks():
    ones = np.ones((4, 256), np.float32)
    a = forward(ones, 0.5, 1)
    assert np.array_equal(a, forward(ones, 0.5, 1))
    assert not np.array_equal(a, forward(ones, 0.5, 2))
    assert not np.array_equal(a, forward(ones, 0.5, 2**32 + 1))
    assert not np.array_equal(a, forward(ones, 0.5, 1, stream=1))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_bad_p_raises_value_error(p):
    x = mgpu.array(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="p must be a probability in"):
        _core.dropout_forward(x._t, p, 0, 0, 0)
    with pytest.raises(ValueError, match="Dropout: p must be a probability"):
        nn.Dropout(p)
    with pytest.raises(ValueError, match="dropout: p must be a probability"):
        mgpu.dropout(x, p)


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="dropout_forward"):
        _core.dropout_forward(mgpu.array(np.ones(3, np.int32))._t, 0.5, 0, 0, 0)
    with pytest.raises(ValueError, match="batch axis"):
        _core.dropout_forward(mgpu.array(np.float32(1.0))._t, 0.5, 0, 0, 0)
    with pytest.raises(ValueError, match="32-bit row counter"):
        _core.dropout_forward(mgpu.array(np.ones((2, 3), np.float32))._t, 0.5, 0, 0, 2**32 - 1)
