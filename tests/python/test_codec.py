"""certkv.codec: GAAC round trips bit for bit on adversarial bit patterns and ragged lengths; the
lossy page codecs give the pages a KvStore of the same rows attends over."""

import numpy as np
import pytest

import certkv
from certkv import codec

SPECIALS = np.array([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F7F, 0x0080],
                    dtype=np.uint16)


def adversarial_bf16(n_tokens, head_dim, seed):
    """Values near 1 of both signs with NaN payloads, infinities, subnormals, -0 mixed in."""
    rng = np.random.default_rng(seed)
    rows = (0x3F00 + rng.integers(0, 0x200, (n_tokens, head_dim))).astype(np.uint16)
    rows |= (rng.integers(0, 2, rows.shape) << 15).astype(np.uint16)
    mask = rng.random(rows.shape) < 0.15
    rows[mask] = rng.choice(SPECIALS, int(mask.sum()))
    return rows


@pytest.mark.parametrize("n_tokens", [1, 3, 17, 129, 501])
def test_bf16_round_trip_bit_exact(n_tokens):
    rows = adversarial_bf16(n_tokens, 64, n_tokens)
    cal = codec.calibrate(rows)
    encoded = codec.encode(rows, cal)
    assert encoded.slots.shape == (n_tokens // 16, cal.slot_bytes)
    assert encoded.tail.shape == (n_tokens % 16, 64)
    decoded = codec.decode(encoded)
    assert decoded.dtype == np.uint16 and np.array_equal(decoded, rows)
    report = codec.verify(rows, cal)
    assert report.ok and report.first_mismatch is None and report.n_tokens == n_tokens


def test_pages_that_do_not_fit_stay_raw_and_round_trip():
    # Calibrated on smooth rows, encoding exponents all over the range: escapes past the slot.
    smooth = np.full((64, 128), 0x3F80, dtype=np.uint16)
    cal = codec.calibrate(smooth)
    wild = np.random.default_rng(1).integers(0, 1 << 16, (64, 128)).astype(np.uint16)
    encoded = codec.encode(wild, cal)
    assert not encoded.fits.all() and encoded.raw_pages.shape[0] == int((~encoded.fits).sum())
    assert np.array_equal(codec.decode(encoded), wild)


def test_compresses_typical_rows():
    rng = np.random.default_rng(2)
    values = rng.normal(0, 1, (256, 64)).astype(np.float32)
    rows = (values.view(np.uint32) >> 16).astype(np.uint16)
    report = codec.verify(rows, codec.calibrate(rows))
    assert report.ok and report.ratio > 1.2


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_fp8_round_trip_every_byte(element):
    rows = (np.arange(40 * 64) * 37 % 256).astype(np.uint8).reshape(40, 64)
    cal = codec.calibrate(rows, element=element)
    assert cal.element == element
    assert np.array_equal(codec.decode(codec.encode(rows, cal)), rows)


def test_ml_dtypes_arrays_are_viewed_as_bits():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rows = adversarial_bf16(40, 64, 3)
    as_bf16 = rows.view(ml_dtypes.bfloat16)
    cal = codec.calibrate(as_bf16)
    assert cal.element == "bf16"
    assert np.array_equal(codec.decode(codec.encode(as_bf16, cal)), rows)
    fp8 = (np.arange(32 * 64) % 256).astype(np.uint8).reshape(32, 64).view(ml_dtypes.float8_e4m3fn)
    assert codec.calibrate(fp8).element == "e4m3"


def test_bad_input_names_the_argument():
    rows = adversarial_bf16(32, 64, 4)
    cal = codec.calibrate(rows)
    with pytest.raises(TypeError, match="rows: expected bf16 bit patterns"):
        codec.calibrate(rows.astype(np.float32))
    with pytest.raises(TypeError, match="rows: expected a numpy.ndarray"):
        codec.calibrate(rows.tolist())
    with pytest.raises(ValueError, match="rows: expected 2 dimensions"):
        codec.calibrate(rows.reshape(-1))
    with pytest.raises(ValueError, match="C-contiguous"):
        codec.encode(rows[:, ::2], cal)
    with pytest.raises(ValueError, match="head_dim 32, but the calibration has head_dim 64"):
        codec.encode(np.ascontiguousarray(rows[:, :32]), cal)
    with pytest.raises(TypeError, match="pass element='e4m3' or 'e5m2'"):
        codec.calibrate(rows.view(np.uint8))
    with pytest.raises(ValueError, match="element: expected one of"):
        codec.calibrate(rows, element="fp16")
    with pytest.raises(certkv.InvalidArgumentError, match="head_dim 12"):
        codec.calibrate(np.zeros((16, 12), dtype=np.uint16))
    with pytest.raises(ValueError, match="block_tokens"):
        codec.calibrate(rows, block_tokens=0)


def test_corrupt_slot_raises():
    rows = adversarial_bf16(32, 64, 5)
    cal = codec.calibrate(rows)
    encoded = codec.encode(rows, cal)
    encoded.slots[:] = 0xFF  # every mode tag 3: invalid
    encoded.used_bytes[:] = 1
    with pytest.raises(certkv.CorruptError):
        codec.decode(encoded)


@pytest.mark.parametrize("kv", ["fp8-e4m3", "rtn4", "kivi2", "dither8"])
def test_lossy_pages_are_a_stores_pages(kv):
    """lossy_encode / lossy_decode of a stream's rows: what a KvStore holding the same rows reads
    back (its layer 1, kv head 1: dither8's dither keyed alike), K pages and V pages, and not the
    exact rows; a row that is not finite leaves its page unencoded."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((2, 48, 64)).astype(np.float32)
    rows[:, :, 3::16] *= 6
    bits = (rows.view(np.uint32) >> 16).astype(np.uint16)
    store = certkv.KvStore(kv, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rope_layout="half-split",
                           recent_window_tokens=0, outlier_pairs=0)
    store.append(0, 1, bits, bits)
    for key, name in ((True, "k"), (False, "v")):
        pages = codec.lossy_encode(bits[1], kv, key=key, rope_layout="half-split", layer=1, kv_head=1)
        assert pages.pages.shape[0] == 3 and pages.encoded.all()
        got = codec.lossy_decode(pages)
        want = store.read(0, 1, name)[1]
        assert np.array_equal(got, want)
        assert not np.array_equal(got, (bits[1].astype(np.uint32) << 16).view(np.float32))
    bad = bits[1].copy()
    bad[20, 7] = 0x7FC0  # NaN in block 1
    assert codec.lossy_encode(bad, kv).encoded.tolist() == [True, False, True]


def test_lossy_refusals():
    rows = np.zeros((32, 64), np.uint16)
    with pytest.raises(certkv.InvalidArgumentError, match="gaac is not a lossy scheme"):
        codec.lossy_encode(rows, "gaac")
    with pytest.raises(ValueError, match="not whole pages"):
        codec.lossy_encode(rows[:20], "dither8")
    with pytest.raises(certkv.CertkvError, match="witness"):
        codec.lossy_encode(rows, "dither8", witness="u8")
    with pytest.raises(TypeError, match="LossyPages"):
        codec.lossy_decode(rows)
