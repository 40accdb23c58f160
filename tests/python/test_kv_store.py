"""certkv.KvStore: rows in, the same rows out (bf16, gaac), attention against NumPy's softmax over
the rows read back, the meter over the true error of a lossy scheme, crop and reorder, sparse
decode, and refusals that name the argument."""

import numpy as np
import pytest

import certkv

SHAPE = dict(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=64)


def bf16_rows(n_tokens, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, n_tokens, 64)).astype(np.float32)
    x[:, :, 3::16] *= 6
    return (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: exact bf16 values


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def softmax_attention(q, k, v, scale):
    # q [n_heads, d]; k, v [n_kv_heads, n, d]; GQA groups of n_heads / n_kv_heads.
    group = q.shape[0] // k.shape[0]
    kk = np.repeat(k.astype(np.float64), group, axis=0)
    vv = np.repeat(v.astype(np.float64), group, axis=0)
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), kk) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, vv), p


@pytest.mark.parametrize("scheme", ["bf16", "gaac"])
def test_rows_come_back_bit_for_bit(scheme):
    store = certkv.KvStore(scheme, n_sequences=2, **SHAPE)
    rows = {}
    for seq in range(2):
        for layer in range(2):
            k, v = bf16_rows(150, 10 * seq + layer), bf16_rows(150, 100 + 10 * seq + layer)
            rows[seq, layer] = (k, v)
            for begin, end in ((0, 129), (129, 130), (130, 133), (133, 150)):
                store.append(seq, layer, np.ascontiguousarray(k[:, begin:end]), np.ascontiguousarray(v[:, begin:end]))
    for (seq, layer), (k, v) in rows.items():
        assert store.length(seq, layer) == 150
        assert np.array_equal(store.read(seq, layer, "k").view(np.uint32) >> 16, k.astype(np.uint32))
        assert np.array_equal(store.read(seq, layer, "v").view(np.uint32) >> 16, v.astype(np.uint32))
    cert = store.certificate()
    assert cert["scheme"] == scheme and cert["metered"] is False
    if scheme == "gaac":
        assert cert["kv_bytes_by_class"].get("gaac", 0) > 0
        assert sum(cert["kv_bytes_by_class"].values()) < cert["kv_bytes_bf16"]


def test_float_rows_and_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    store = certkv.KvStore("bf16", **SHAPE)
    x = np.linspace(-3, 3, 2 * 5 * 64, dtype=np.float32).reshape(2, 5, 64)
    store.append(0, 0, x, x)
    assert np.array_equal(store.read(0, 0, "k"), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    store.append(0, 1, x.astype(ml_dtypes.bfloat16), x.astype(ml_dtypes.bfloat16))
    assert np.array_equal(store.read(0, 1, "v"), store.read(0, 0, "v"))


@pytest.mark.parametrize("scheme", ["gaac", "dither8", "fp8-e4m3"])
def test_attend_matches_softmax_and_the_meter_bounds_the_error(scheme):
    store = certkv.KvStore(scheme, rope_layout="half-split", **SHAPE)
    k, v = bf16_rows(200, 1), bf16_rows(200, 2)
    store.append(0, 0, np.ascontiguousarray(k[:, :180]), np.ascontiguousarray(v[:, :180]))
    rng = np.random.default_rng(3)
    largest = 0.0
    for n in range(181, 201):
        store.append(0, 0, np.ascontiguousarray(k[:, n - 1:n]), np.ascontiguousarray(v[:, n - 1:n]))
        q = rng.standard_normal((6, 64)).astype(np.float32) * 1.5
        out, meters = store.attend(0, 0, q)
        assert out.shape == (6, 64) and meters.shape == (6,)
        want, p_hat = softmax_attention(q, store.read(0, 0, "k"), store.read(0, 0, "v"), 1 / 8)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        exact, p = softmax_attention(q, store.read(0, 0, "k", exact=True), store.read(0, 0, "v", exact=True), 1 / 8)
        tv = 0.5 * np.abs(p - p_hat).sum(axis=1)
        assert (meters["meter"] >= tv).all()
        assert (meters["output_bound"] >= np.linalg.norm(want - exact, axis=1)).all()
        largest = max(largest, meters["meter"].max())
    cert = store.certificate()
    if scheme == "gaac":
        assert largest == 0 and cert["metered"] is False
    else:
        assert largest > 0
        assert cert["metered"] and cert["cells"] == 20 * 6
        assert cert["meter_max"] == pytest.approx(largest, rel=0.004)
        assert cert["tier"] == ("B" if scheme == "dither8" else "A")
    # A prefill of the last 4 positions, causal.
    q4 = rng.standard_normal((4, 6, 64)).astype(np.float32)
    out4, none = store.attend(0, 0, q4)
    assert none is None and out4.shape == (4, 6, 64)
    if scheme == "gaac":
        kr, vr = store.read(0, 0, "k"), store.read(0, 0, "v")
        for i in range(4):
            n = 197 + i
            want, _ = softmax_attention(q4[i], kr[:, :n], vr[:, :n], 1 / 8)
            np.testing.assert_allclose(out4[i], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scheme", ["rtn4", "kivi2"])
def test_gate_repairs_steps_above_tau(scheme):
    tau = 0.02
    gated = certkv.KvStore(scheme, rope_layout="half-split", gate=True, meter_tau=tau, **SHAPE)
    plain = certkv.KvStore(scheme, rope_layout="half-split", meter_tau=tau, **SHAPE)
    k, v = bf16_rows(160, 7), bf16_rows(160, 8)
    rng = np.random.default_rng(9)
    for store in (gated, plain):
        store.append(0, 1, np.ascontiguousarray(k[:, :150]), np.ascontiguousarray(v[:, :150]))
    fired = 0
    for n in range(151, 161):
        q = rng.standard_normal((6, 64)).astype(np.float32) * 1.5
        for store in (gated, plain):
            store.append(0, 1, np.ascontiguousarray(k[:, n - 1:n]), np.ascontiguousarray(v[:, n - 1:n]))
        _, plain_meters = plain.attend(0, 1, q)
        fired += int((plain_meters["meter"] > tau).any())
        out, meters = gated.attend(0, 1, q)
        # The repaired step: attention over the pages as they now are, its meter a bound under tau.
        want, p_hat = softmax_attention(q, gated.read(0, 1, "k"), gated.read(0, 1, "v"), 1 / 8)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
        _, p = softmax_attention(q, gated.read(0, 1, "k", exact=True), gated.read(0, 1, "v", exact=True), 1 / 8)
        assert (meters["meter"] >= 0.5 * np.abs(p - p_hat).sum(axis=1)).all()
        assert (meters["meter"] <= tau).all()
    assert fired > 0, "the ungated store's meters must pass tau for this test to test the gate"
    cert, plain_cert = gated.certificate(), plain.certificate()
    assert cert["gate_repairs"] > 0 and cert["pagein_bytes"] > 0 and plain_cert["gate_repairs"] == 0
    assert cert["cells"] == 10 * 6
    with pytest.raises(certkv.InvalidArgumentError, match="kv gaac is lossless"):
        certkv.KvStore("gaac", gate=True, **SHAPE)
    with pytest.raises(TypeError, match="gate"):
        certkv.KvStore(scheme, gate=1, **SHAPE)


def test_crop_and_reorder():
    store = certkv.KvStore("gaac", n_sequences=2, **SHAPE)
    a, b = bf16_rows(70, 5), bf16_rows(90, 6)
    for layer in range(2):
        store.append(0, layer, a, a)
        store.append(1, layer, b, b)
    store.crop(0, 37)
    assert [store.length(0, layer) for layer in range(2)] == [37, 37]
    assert np.array_equal(store.read(0, 1, "k"), bf16_to_f32(a[:, :37]))
    store.reorder([1, 1])
    assert store.length(0, 0) == 90 and np.array_equal(store.read(0, 0, "v"), bf16_to_f32(b))
    store.crop(1, 0)
    assert store.length(1, 1) == 0 and store.length(0, 1) == 90


def test_select_grows_and_narrows_the_batch():
    store = certkv.KvStore("gaac", n_sequences=2, **SHAPE)
    a, b = bf16_rows(70, 5), bf16_rows(90, 6)
    for layer in range(2):
        store.append(0, layer, a, a)
        store.append(1, layer, b, b)
    pages = sum(store.kv_stats()["pages_by_class"].values())
    store.select([1, 0, 1])
    assert store.n_sequences == 3
    assert [store.length(i, 1) for i in range(3)] == [90, 70, 90]
    assert np.array_equal(store.read(2, 1, "k"), bf16_to_f32(b)) and np.array_equal(store.read(1, 0, "v"), bf16_to_f32(a))
    assert sum(store.kv_stats()["pages_by_class"].values()) == pages  # the copy shares b's pages
    head = np.ascontiguousarray(a[:, :3])
    store.append(0, 0, head, head)  # one copy goes on alone
    assert store.length(0, 0) == 93 and store.length(2, 0) == 90
    with pytest.raises(certkv.OutOfRangeError, match="src\\[0\\] 3"):
        store.select([3])
    with pytest.raises(ValueError, match="at least one"):
        store.select([])
    assert store.n_sequences == 3  # refused: unchanged
    store.select([1])
    assert store.n_sequences == 1 and store.length(0, 1) == 70
    with pytest.raises(certkv.OutOfRangeError):
        store.length(1, 0)


def test_sparse_decode():
    """sparse=p: at p = 1 a decode step attends every token (dense attention summed in another
    order); at p = 0.5 fewer. Layer 0 stays dense (dense_layers 1); the budget and the indexed
    prefix (whole blocks before the 32-token window, in batches of 32) come back in sparse_stats
    and the certificate."""
    n = 600
    k, v = bf16_rows(n, 61), bf16_rows(n, 62)
    spec = {"window": 32, "dense_layers": 1}
    stores = [certkv.KvStore("fp8-e4m3", **SHAPE, rope_layout="half-split", sparse=None if p is None else {"p": p, **spec})
              for p in (None, 1.0, 0.5)]
    q = np.random.default_rng(63).standard_normal((6, 64)).astype(np.float32) * 1.5
    outs, meters = [], []
    for s in stores:
        for layer in range(2):
            s.append(0, layer, k, v)
        out, m = s.attend(0, 1, q)
        outs.append(out)
        meters.append(m["meter"])
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(meters[1], meters[0], rtol=1e-4)
    assert np.isfinite(outs[2]).all() and (meters[2] > 0).all()
    dense, full, half = (s.sparse_stats() for s in stores)
    assert dense["sparse"] is False
    assert full["sparse"] is True and full["cells"] == 6 and full["mean_budget"] == 1.0
    assert half["p"] == 0.5 and half["window_tokens"] == 32 and half["dense_layers"] == 1
    assert 32 / n < half["mean_budget"] < 0.9 and half["index_bytes"] > 0
    cert = stores[2].certificate()
    assert cert["sparse"]["p"] == 0.5 and cert["sparse"]["mean_budget"] == half["mean_budget"]
    assert "sparse" not in stores[0].certificate()
    with pytest.raises(ValueError, match="sparse: expected p"):
        certkv.KvStore("bf16", **SHAPE, sparse={"q": 0.9})
    with pytest.raises(ValueError, match="sparse: expected p"):
        certkv.KvStore("bf16", **SHAPE, sparse="0.9")
    with pytest.raises(certkv.InvalidArgumentError, match="sparse_p 1.5"):
        certkv.KvStore("bf16", **SHAPE, sparse=1.5)
    with pytest.raises(certkv.UnsupportedError, match="the gate and sparse decode"):
        certkv.KvStore("fp8-e4m3", **SHAPE, sparse=0.9, gate=True)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="'int3'"):
        certkv.KvStore("int3", **SHAPE)
    with pytest.raises(ValueError, match="n_heads 5"):
        certkv.KvStore("bf16", n_layers=1, n_heads=5, n_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="rope_layout"):
        certkv.KvStore("bf16", rope_layout="neox", **SHAPE)
    with pytest.raises(TypeError, match="n_layers"):
        certkv.KvStore("bf16", n_layers=2.0, n_heads=6, n_kv_heads=2, head_dim=64)
    with pytest.raises(certkv.UnsupportedError, match="head_dim 12"):
        certkv.KvStore("gaac", n_layers=1, n_heads=2, n_kv_heads=2, head_dim=12)
    store = certkv.KvStore("bf16", max_tokens=64, **SHAPE)
    rows = bf16_rows(3, 0)
    with pytest.raises(ValueError, match=r"k: expected shape \[2, n_tokens >= 1, 64\]"):
        store.append(0, 0, rows[:1], rows[:1])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.append(0, 0, rows[:, ::2], rows[:, ::2])
    with pytest.raises(TypeError, match="k: expected bf16 bit patterns"):
        store.append(0, 0, rows.astype(np.int32), rows.astype(np.int32))
    with pytest.raises(TypeError, match="v: expected the kind of k"):
        store.append(0, 0, rows, bf16_to_f32(rows))
    with pytest.raises(IndexError, match="layer 2 outside"):
        store.append(0, 2, rows, rows)
    with pytest.raises(certkv.OutOfRangeError, match="seq 1 outside"):
        store.append(1, 0, rows, rows)
    with pytest.raises(ValueError, match=r"q: expected shape \[6, 64\]"):
        store.attend(0, 0, np.zeros((6, 32), np.float32))
    with pytest.raises(TypeError, match="q: expected a floating-point array"):
        store.attend(0, 0, np.zeros((6, 64), np.int32))
    with pytest.raises(ValueError, match="n_queries 1"):  # nothing stored yet
        store.attend(0, 0, np.zeros((6, 64), np.float32))
    with pytest.raises(certkv.CertkvError, match="capacity|pages|out of"):
        store.append(0, 0, bf16_rows(80, 1), bf16_rows(80, 1))
    with pytest.raises(ValueError, match="kv: expected 'k' or 'v'"):
        store.read(0, 0, "q")
    with pytest.raises(ValueError, match="src: expected 1 entries"):
        store.reorder([0, 0])
