"""certkv's torch custom operators on CPU tensors: the same results as the NumPy API, the same
under torch.compile (their fake kernels trace), and a clear refusal of CUDA tensors where an
operator or store is CPU-only (the CUDA path: test_transformers_cuda.py). Skipped where torch is
not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import certkv  # noqa: E402
import certkv.codec  # noqa: E402
import certkv.torch_ops as ops  # noqa: E402


def bf16_rows(n_tokens, seed, heads=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((heads, n_tokens, 64)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def store():
    s = certkv.KvStore("dither8", n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, rope_layout="half-split")
    s.append(0, 0, bf16_rows(70, 1), bf16_rows(70, 2))
    return s


def test_kv_store_attend_op_equals_the_store(store):
    handle = ops.register_store(store)
    q = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    out, meters = torch.ops.certkv.kv_store_attend(handle, 0, 0, q)
    want, want_meters = store.attend(0, 0, q.numpy())
    assert torch.equal(out, torch.from_numpy(want))
    assert np.array_equal(meters[:, 0].numpy(), want_meters["meter"]) and (meters[:, 0] > 0).all()
    assert np.array_equal(meters[:, 4].numpy(), want_meters["output_bound"])

    def step(q):
        out, meters = torch.ops.certkv.kv_store_attend(handle, 0, 0, q * 2)
        return out.sum(-1), meters[:, 0].max()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q)
    plain = step(q)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_kv_store_decode_op_equals_the_store():
    s = certkv.KvStore("dither8", n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, rope_layout="half-split",
                       n_sequences=3)
    for seq, n in enumerate((70, 17, 33)):
        s.append(seq, 0, bf16_rows(n, 10 + seq), bf16_rows(n, 20 + seq))
    handle = ops.register_store(s)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
    out, meter = torch.ops.certkv.kv_store_decode(handle, 0, [2, 0], q)
    assert out.shape == (2, 4, 64) and meter.shape == (2, 4) and meter.dtype == torch.float32
    for i, seq in enumerate((2, 0)):
        want, want_meters = s.attend(seq, 0, q[i].numpy())
        assert torch.equal(out[i], torch.from_numpy(want))
        assert np.array_equal(meter[i].numpy(), want_meters["meter"].astype(np.float32)) and (meter[i] > 0).all()

    def step(q):
        out, meter = torch.ops.certkv.kv_store_decode(handle, 0, [1, 2], q)
        return out.sum(-1), meter.max()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got, plain = compiled(q), step(q)
    assert got[0].shape == plain[0].shape == (2, 4) and got[1].shape == plain[1].shape == ()


def test_kv_store_decode_op_over_a_sparse_store():
    """A store made with sparse=... decodes sparsely through the operator too: the same output as
    the store's own call at the same position (the index and the query rounding depend on the
    position alone), fewer tokens than the context."""
    s = certkv.KvStore("bf16", n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, rope_layout="half-split",
                       n_sequences=2, sparse={"p": 0.5, "window": 16, "dense_layers": 0})
    for seq, n in enumerate((300, 170)):
        s.append(seq, 0, bf16_rows(n, 30 + seq), bf16_rows(n, 40 + seq))
    handle = ops.register_store(s)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    out, meter = torch.ops.certkv.kv_store_decode(handle, 0, [1, 0], q)
    for i, seq in enumerate((1, 0)):
        want, _ = s.attend(seq, 0, q[i].numpy())
        assert torch.equal(out[i], torch.from_numpy(want))
    stats = s.sparse_stats()
    assert stats["cells"] == 4 * 4 and stats["mean_budget"] < 1.0
    assert (meter == 0).all()  # bf16: lossless, nothing to bound


def test_lossy_page_ops_equal_the_codec_under_compile():
    """torch.ops.certkv.lossy_encode_pages / lossy_decode_pages give certkv.codec's pages and
    reconstruction (dither8 K pages with two outlier pairs, from block 2), eager and compiled."""
    rows = bf16_rows(48, 9, heads=1)[0]
    want = certkv.codec.lossy_encode(rows, "dither8", key=True, rope_layout="half-split", layer=2, kv_head=0,
                                     outlier_pairs=(1, 6), first_block=2)
    pages = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).reshape(3, 16, 64)

    def round_trip(pages):
        data, encoded = torch.ops.certkv.lossy_encode_pages(pages, "dither8", True, "half-split", None, 2, 0, [1, 6], 2)
        out = torch.ops.certkv.lossy_decode_pages(data, "dither8", True, 16, 64, "half-split", None, 2, 0, [1, 6], 2)
        return data, encoded, out

    for fn in (round_trip, torch.compile(round_trip, backend="aot_eager", fullgraph=True)):
        data, encoded, out = fn(pages)
        assert torch.equal(data, torch.from_numpy(want.pages)) and encoded.all()
        assert torch.equal(out.reshape(48, 64), torch.from_numpy(certkv.codec.lossy_decode(want)))
    with pytest.raises(ValueError, match="bytes per page"):
        torch.ops.certkv.lossy_decode_pages(data[:, :-1].contiguous(), "dither8", True, 16, 64, "half-split", None, 2,
                                            0, [1, 6], 2)


def test_gaac_page_ops_round_trip_under_compile():
    rows = bf16_rows(64, 5, heads=1)[0]
    cal = certkv.codec.calibrate(rows, block_tokens=16)
    b3, b4 = torch.from_numpy(cal.b3), torch.from_numpy(cal.b4)
    pages = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16).reshape(4, 16, 64)

    def round_trip(pages):
        slots, used = torch.ops.certkv.gaac_encode_pages(pages, b3, b4, cal.escape_capacity_bytes)
        return torch.ops.certkv.gaac_decode_pages(slots, b3, b4, cal.escape_capacity_bytes, 16, 64), used

    for fn in (round_trip, torch.compile(round_trip, backend="aot_eager", fullgraph=True)):
        back, used = fn(pages)
        fitted = used > 0
        assert fitted.any()
        assert torch.equal(back[fitted].view(torch.int16), pages[fitted].view(torch.int16))


def test_refusals(store):
    with pytest.raises(ValueError, match="names no live certkv.KvStore"):
        torch.ops.certkv.kv_store_attend(10 ** 6, 0, 0, torch.zeros(4, 64))
    handle = ops.register_store(store)
    with pytest.raises(TypeError, match="q: expected torch.float32"):
        torch.ops.certkv.kv_store_attend(handle, 0, 0, torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="store: expected a certkv.KvStore"):
        ops.register_store(object())
    with pytest.raises(TypeError, match="pages: expected torch.bfloat16"):
        torch.ops.certkv.gaac_encode_pages(torch.zeros(1, 16, 64), torch.zeros(64, dtype=torch.uint8),
                                           torch.zeros(64, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match=r"q: expected shape \[2, 4, 64\]"):
        torch.ops.certkv.kv_store_decode(handle, 0, [0, 0], torch.zeros(1, 4, 64))
    with pytest.raises(TypeError, match="q: expected torch.float32"):
        torch.ops.certkv.kv_store_decode(handle, 0, [0], torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="use certkv::kv_store_decode"):
            torch.ops.certkv.kv_store_attend(handle, 0, 0, torch.zeros(4, 64, device="cuda"))
        with pytest.raises(ValueError, match="takes CPU tensors"):
            torch.ops.certkv.kv_store_decode(handle, 0, [0], torch.zeros(1, 4, 64, device="cuda"))
