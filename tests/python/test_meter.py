"""certkv.meter: the Tier A and Tier B bounds against the formulas of docs/meter.md in NumPy
(float64), the known two-token case, soundness on random rows, and bad input."""

import math

import numpy as np
import pytest

import certkv
from certkv import meter


def pair_channels(d, layout):
    j = np.arange(d // 2)
    return (2 * j, 2 * j + 1) if layout == "interleaved" else (j, j + d // 2)


def band_of_pair(d):
    n_bands = min(16, d // 2)
    return (np.arange(d // 2) * n_bands) // (d // 2), n_bands


def meter_from(s_hat, c):
    log_a = np.logaddexp.reduce(s_hat + c) - np.logaddexp.reduce(s_hat)
    return min(1.0, (math.exp(2 * log_a) - 1) / 2), log_a


def tier_a_reference(q, k, k_hat, scale, layout):
    q, k, k_hat = (x.astype(np.float64) for x in (q, k, k_hat))
    d = q.shape[0]
    a, b = pair_channels(d, layout)
    band, n_bands = band_of_pair(d)
    pair_q = q[a] ** 2 + q[b] ** 2
    r = k_hat - k
    pair_r = r[:, a] ** 2 + r[:, b] ** 2
    q_band = np.sqrt(np.bincount(band, pair_q, n_bands))
    w = np.sqrt(np.stack([np.bincount(band, row, n_bands) for row in pair_r]))
    c = abs(scale) * (w * q_band).sum(axis=1)
    return c, meter_from(scale * k_hat @ q, c)


def tier_b_reference(q, k_hat, scales, scale, delta_loc):
    q, k_hat, scales = (x.astype(np.float64) for x in (q, k_hat, scales))
    s_c = np.repeat(scales, 32, axis=1)
    sigma2 = scale ** 2 * (q ** 2 * s_c ** 2).sum(axis=1) / 12
    c = np.sqrt(2 * sigma2 * math.log(2 * k_hat.shape[0] / delta_loc)) + abs(scale) * (np.abs(q) * s_c).sum(axis=1) / 256
    return c, meter_from(scale * k_hat @ q, c)


def test_two_token_known_answer():
    q = np.array([1, 0, 0, 0], dtype=np.float32)
    k = np.zeros((2, 4), dtype=np.float32)
    k_hat = k.copy()
    k_hat[:, 0] = 0.1
    row = meter.tier_a(q, k, k_hat, sm_scale=1.0)
    assert row.meter == pytest.approx((math.exp(2 * 0.1) - 1) / 2, rel=1e-6)
    assert row.tv == pytest.approx(0.0, abs=1e-12)
    assert row.bounds.shape == (2,) and row.max_bound == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "half-split"])
def test_tier_a_equals_the_reference_and_is_sound(layout):
    rng = np.random.default_rng(0)
    d, n = 64, 37
    q = rng.normal(0, 1, d).astype(np.float32)
    k = rng.normal(0, 1, (n, d)).astype(np.float32)
    k_hat = (k + rng.normal(0, 0.02, (n, d))).astype(np.float32)
    row = meter.tier_a(q, k, k_hat, rope_layout=layout)
    c, (want_meter, want_log_a) = tier_a_reference(q, k, k_hat, 1 / math.sqrt(d), layout)
    np.testing.assert_allclose(row.bounds, c, rtol=1e-6)
    assert np.all(row.bounds >= c * (1 - 1e-12))
    assert row.meter == pytest.approx(want_meter, rel=1e-5)
    assert row.log_a == pytest.approx(want_log_a, rel=1e-5)
    assert row.tv <= row.meter


def test_tier_b_equals_the_reference():
    rng = np.random.default_rng(1)
    d, n = 64, 20
    q = rng.normal(0, 1, d).astype(np.float32)
    k = rng.normal(0, 1, (n, d)).astype(np.float32)
    scales = (np.abs(k).reshape(n, 2, 32).max(axis=2) / 126.5).astype(np.float32)
    k_hat = k.copy()
    row = meter.tier_b(q, k, k_hat, scales, delta_loc=1e-6, sm_scale=0.125)
    c, (want_meter, _) = tier_b_reference(q, k_hat, scales, 0.125, 1e-6)
    np.testing.assert_allclose(row.bounds, c, rtol=1e-9)
    assert row.meter == pytest.approx(want_meter, rel=1e-9)
    # An outlier pair is exact: it leaves the bound.
    assert meter.tier_b(q, k, k_hat, scales, delta_loc=1e-6, outlier_pairs=[0, 5]).max_bound < row.max_bound


def test_bad_input_names_the_argument():
    q = np.ones(64, dtype=np.float32)
    k = np.ones((4, 64), dtype=np.float32)
    with pytest.raises(TypeError, match="q: expected a floating-point array"):
        meter.tier_a(q.astype(np.int32), k, k)
    with pytest.raises(ValueError, match="k_hat: expected the shape of k"):
        meter.tier_a(q, k, k[:3])
    with pytest.raises(ValueError, match="k: expected shape \\[n_tokens, 64\\]"):
        meter.tier_a(q, np.ones((4, 32), dtype=np.float32), np.ones((4, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        meter.tier_a(q, np.ones((4, 128), dtype=np.float32)[:, ::2], k)
    with pytest.raises(ValueError, match="rope_layout"):
        meter.tier_a(q, k, k, rope_layout="sideways")
    bad = k.copy()
    bad[0, 0] = np.nan
    with pytest.raises(certkv.InvalidArgumentError, match="k_hat has a non-finite value"):
        meter.tier_a(q, k, bad)
    with pytest.raises(ValueError, match="scales: expected shape \\(4, 2\\)"):
        meter.tier_b(q, k, k, np.ones((4, 3), dtype=np.float32), delta_loc=1e-3)
    with pytest.raises(ValueError, match="delta_loc"):
        meter.tier_b(q, k, k, np.ones((4, 2), dtype=np.float32), delta_loc=1.5)
    with pytest.raises(ValueError, match="outlier_pairs"):
        meter.tier_b(q, k, k, np.ones((4, 2), dtype=np.float32), delta_loc=1e-3, outlier_pairs=[3, 1])
