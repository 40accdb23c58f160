"""certkv.index: records and estimates as the C++ index layer computes them, Top-p selection as a
NumPy brute force of its definition (1/256-logit buckets, the whole threshold bucket taken), and
refusals that name the argument."""

import math
from fractions import Fraction

import numpy as np
import pytest

import certkv
from certkv import index


def gaussian_head(head_dim, seed, rotation="haar"):
    rng = np.random.default_rng(seed)
    return index.Head(rng.normal(0, 1, head_dim).astype(np.float32),
                      rng.normal(0.5, 1, head_dim).astype(np.float32), rotation=rotation, seed=seed)


@pytest.mark.parametrize("head_dim,rotation", [(32, "haar"), (64, "hadamard"), (96, "haar"), (128, "hadamard")])
def test_estimates_equal_the_reference_estimator(head_dim, rotation):
    head = gaussian_head(head_dim, 1, rotation)
    rng = np.random.default_rng(2)
    k = rng.normal(0, 1, (17, head_dim)).astype(np.float32)
    q = rng.normal(0, 1, head_dim).astype(np.float32)
    records = index.encode_keys(head, k)
    assert records.shape == (17,) and records.dtype == index.record_dtype(head_dim)
    assert records.dtype.itemsize == {32: 24, 64: 24, 96: 32, 128: 32}[head_dim]
    assert ((records["alpha"] > 0) & (records["alpha"] <= 1)).all()
    np.testing.assert_allclose(records["norm_k_centered"], np.linalg.norm(k - head.c_k, axis=1), rtol=1e-5)
    np.testing.assert_allclose(records["cq_dot_k"], k @ head.c_q, rtol=1e-4, atol=1e-4)
    popcounts = [sum(bin(int(w)).count("1") for w in code) for code in records["code"]]
    assert list(records["code_popcount"]) == popcounts
    scores, scores_ref = index.estimate_scores(head, records, q, rounding_seed=3, reference=True)
    assert scores.dtype == np.float32 and scores.shape == (17,)
    np.testing.assert_allclose(scores, scores_ref, rtol=1e-4, atol=1e-4)
    assert np.array_equal(index.estimate_scores(head, records, q, rounding_seed=3), scores)


def test_a_key_at_the_centroid_and_a_query_at_its_centroid_score_by_eq6():
    head = gaussian_head(64, 4)
    rng = np.random.default_rng(5)
    k = rng.normal(0, 1, (5, 64)).astype(np.float32)
    k[2] = head.c_k
    q = rng.normal(0, 1, 64).astype(np.float32)
    scores = index.estimate_scores(head, index.encode_keys(head, k), q)
    assert scores[2] == pytest.approx(float(head.c_k.astype(np.float64) @ q), rel=1e-4)
    # q == c_q: the product term of Eq. 6 vanishes and <q, c_k> + <c_q, k> - <c_q, c_k> = <q, k>.
    at_centroid = index.estimate_scores(head, index.encode_keys(head, k), head.c_q)
    np.testing.assert_allclose(at_centroid, k.astype(np.float64) @ head.c_q, rtol=1e-4, atol=1e-4)


def test_estimates_are_unbiased_over_rotations():
    rng = np.random.default_rng(6)
    k = rng.normal(0, 1, (8, 64)).astype(np.float32)
    q = rng.normal(0, 1, 64).astype(np.float32)
    c_q, c_k = np.zeros(64, np.float32), np.zeros(64, np.float32)
    mean = np.mean([index.estimate_scores(index.Head(c_q, c_k, seed=s), index.encode_keys(index.Head(c_q, c_k, seed=s), k),
                                          q, rounding_seed=s) for s in range(200)], axis=0)
    exact = k.astype(np.float64) @ q
    assert np.abs(mean - exact).max() < 0.1 * np.linalg.norm(q) * np.linalg.norm(k, axis=1).max() / 8 + 0.3


def brute_force_top_p(logits, p):
    """The definition of docs/sparse.md in exact arithmetic: buckets of 1/256 logit below the
    largest; the threshold bucket B is the first whose upper set's lower-bound mass
    sum_{a_t <= B} L(a_t) / (that + sum_{a_t > B} U(a_t)) reaches p; every token of B is taken."""
    l = logits.astype(np.float32)
    gap = (np.float32(l.max()) - l).astype(np.float32) * np.float32(256)
    buckets = np.minimum(11264, np.floor(gap.astype(np.float64))).astype(np.int64)
    s = 63 - math.ceil(math.log2(len(l))) if len(l) > 1 else 63
    def upper(a):
        return 1 if a == 11264 else math.ceil(2.0 ** s * math.exp(-a * (1 - 2.0 ** -23) / 256) * (1 + 2.0 ** -50))
    def lower(a):
        return 0 if a == 11264 else math.floor(2.0 ** s * math.exp(-(a + 1) * (1 + 2.0 ** -23) / 256) * (1 - 2.0 ** -50))
    for b in sorted(set(buckets.tolist())):
        low = sum(lower(a) for a in buckets[buckets <= b].tolist())
        up = sum(upper(a) for a in buckets[buckets > b].tolist())
        if low >= math.ceil(Fraction(p) * (low + up)):
            return buckets <= b, b
    raise AssertionError("no bucket reached p")


@pytest.mark.parametrize("n", [1, 3, 17, 129, 501])
@pytest.mark.parametrize("p", [0.5, 0.9, 0.99, 1.0])
def test_top_p_equals_the_brute_force_of_its_definition(n, p):
    rng = np.random.default_rng(n)
    logits = (np.round(rng.normal(0, 3, n) * 64) / 64).astype(np.float32)  # ties inside buckets
    sel = index.top_p_select(logits, p)
    mask, bucket = brute_force_top_p(logits, p)
    assert sel.bucket == bucket
    assert np.array_equal(sel.mask, mask) and sel.n_selected == int(mask.sum())
    assert np.array_equal(sel.mask, logits >= sel.threshold)
    assert sel.mass >= p
    exact = np.exp(logits.astype(np.float64) - logits.max())
    assert exact[sel.mask].sum() / exact.sum() >= p - 1e-12
    gaps = np.floor((np.float32(logits.max()) - logits) * np.float32(256))
    assert sel.n_boundary == int((np.minimum(gaps, 11264) == bucket).sum())


def test_top_p_takes_the_whole_threshold_bucket():
    logits = np.array([5.0, 1.0, 1.0, 1.0, 0.999, -3.0], dtype=np.float32)  # gaps 4 and 4.001: one bucket
    sel = index.top_p_select(logits, 0.99)
    assert sel.mask.tolist() == [True, True, True, True, True, False]
    assert sel.n_boundary == 4


def test_bad_input_names_the_argument():
    head = gaussian_head(64, 7)
    k = np.ones((4, 64), np.float32)
    records = index.encode_keys(head, k)
    with pytest.raises(ValueError, match="c_q: head_dim 48"):
        index.Head(np.zeros(48, np.float32), np.zeros(48, np.float32))
    with pytest.raises(ValueError, match="c_k: expected head_dim 64"):
        index.Head(np.zeros(64, np.float32), np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="rotation: expected one of haar, hadamard"):
        index.Head(head.c_q, head.c_k, rotation="givens")
    with pytest.raises(certkv.InvalidArgumentError, match="power of two"):
        index.encode_keys(index.Head(np.zeros(96, np.float32), np.zeros(96, np.float32), rotation="hadamard"),
                          np.ones((2, 96), np.float32))
    with pytest.raises(TypeError, match="c_q: expected a numpy.ndarray"):
        index.Head([0.0] * 64, head.c_k)
    with pytest.raises(TypeError, match="k: expected a floating-point array"):
        index.encode_keys(head, np.ones((4, 64), np.int32))
    with pytest.raises(ValueError, match="k: head_dim 32, but the head has head_dim 64"):
        index.encode_keys(head, np.ones((4, 32), np.float32))
    with pytest.raises(certkv.InvalidArgumentError, match="k has a non-finite value"):
        index.encode_keys(head, np.full((4, 64), np.nan, np.float32))
    with pytest.raises(TypeError, match="head: expected a certkv.index.Head"):
        index.encode_keys("head", k)
    with pytest.raises(TypeError, match="records: expected records of head_dim 64"):
        index.estimate_scores(head, records.view(np.uint8), k[0])
    with pytest.raises(TypeError, match="records: expected records of head_dim 128"):
        index.estimate_scores(gaussian_head(128, 1), records, np.ones(128, np.float32))
    with pytest.raises(ValueError, match="q: expected head_dim 64 values"):
        index.estimate_scores(head, records, k[0, :32].copy())
    with pytest.raises(ValueError, match="rounding_seed"):
        index.estimate_scores(head, records, k[0], rounding_seed=-1)
    # Records that did not come from encode_keys: refused naming the token and the field.
    broken = records.copy()
    broken["alpha"][1] = 0.0
    with pytest.raises(certkv.InvalidArgumentError, match="record 1: alpha is not in"):
        index.estimate_scores(head, broken, k[0])
    broken = records.copy()
    broken["code_popcount"][0] += 1
    with pytest.raises(certkv.InvalidArgumentError, match="record 0: code_popcount"):
        index.estimate_scores(head, broken, k[0])
    with pytest.raises(ValueError, match="p: expected a number in"):
        index.top_p_select(np.zeros(3, np.float32), 0.0)
    with pytest.raises(ValueError, match="p: expected a number in"):
        index.top_p_select(np.zeros(3, np.float32), 1.5)
    with pytest.raises(ValueError, match="logits: every logit must be finite"):
        index.top_p_select(np.array([0.0, np.inf], np.float32), 0.9)
    with pytest.raises(ValueError, match="logits: expected at least one"):
        index.top_p_select(np.zeros(0, np.float32), 0.9)
    with pytest.raises(ValueError, match="logits: expected 1 dimensions"):
        index.top_p_select(np.zeros((2, 2), np.float32), 0.9)
