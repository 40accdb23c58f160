"""certkv.kvdump: KV dumps and safetensors files round trip bit for bit; corrupt, truncated and
malformed files raise certkv.CorruptError naming the file (never a crash)."""

import numpy as np
import pytest

import certkv
from certkv import kvdump


def small_dump(n_tokens=5, n_kv_heads=2, n_heads=6, head_dim=8, layers=(0, 3)):
    rng = np.random.default_rng(1)
    bits = lambda: rng.integers(0, 1 << 16, (n_kv_heads, n_tokens, head_dim)).astype(np.uint16)
    return kvdump.KvDump(k={l: bits() for l in layers}, v={l: bits() for l in layers},
                         q={l: rng.normal(0, 1, (n_heads, head_dim)).astype(np.float32) for l in layers},
                         tokens=np.arange(1, n_tokens + 1, dtype=np.int32),
                         metadata={"model": "test", "rope_layout": "half-split", "n_layers": "4"})


def test_round_trip(tmp_path):
    dump = small_dump()
    path = tmp_path / "kv.safetensors"
    kvdump.write(path, dump)
    back = kvdump.read(path)
    assert back.layers == [0, 3] and back.n_tokens == 5 and back.head_dim == 8
    assert back.n_kv_heads == 2 and back.n_heads == 6
    for l in dump.layers:
        assert back.k[l].dtype == np.uint16 and np.array_equal(back.k[l], dump.k[l])
        assert np.array_equal(back.v[l], dump.v[l])
        assert back.q[l].dtype == np.float32 and np.array_equal(back.q[l], dump.q[l])
    assert np.array_equal(back.tokens, dump.tokens)
    assert back.metadata["format"] == kvdump.FORMAT and back.metadata["layers"] == "0,3"
    assert back.metadata["model"] == "test" and back.metadata["n_layers"] == "4"
    assert back.metadata["softmax_scale"] == f"{1 / np.sqrt(8):.9g}"
    tensors, metadata = kvdump.read_safetensors(path)
    assert list(tensors) == ["layer0.k", "layer0.v", "layer0.q", "layer3.k", "layer3.v", "layer3.q", "tokens"]
    assert metadata == back.metadata


def test_a_dump_stream_feeds_the_codec(tmp_path):
    dump = small_dump(n_tokens=40, head_dim=64, layers=(1,))
    kvdump.write(tmp_path / "kv.safetensors", dump)
    rows = kvdump.read(tmp_path / "kv.safetensors").k[1][0]
    assert certkv.codec.verify(rows, certkv.codec.calibrate(rows)).ok


def test_safetensors_round_trip_of_other_dtypes(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.array([True, False]),
               "c": ("BF16", np.array([0x3F80, 0xFFFF], np.uint16)), "d": np.zeros((0, 4), np.int64)}
    kvdump.write_safetensors(tmp_path / "t.safetensors", tensors, {"note": "x"})
    back, metadata = kvdump.read_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"note": "x"}
    assert back["a"].dtype == np.float64 and np.array_equal(back["a"], tensors["a"])
    assert np.array_equal(back["b"], tensors["b"])
    assert back["c"].dtype == np.uint16 and np.array_equal(back["c"], tensors["c"][1])
    assert back["d"].shape == (0, 4)


def written(tmp_path, dump=None):
    path = tmp_path / "kv.safetensors"
    kvdump.write(path, dump or small_dump())
    return path


def test_truncated_and_damaged_files_raise_corrupt(tmp_path):
    path = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(certkv.CorruptError, match=str(path)):
        kvdump.read(path)
    path.write_bytes(data[:5])
    with pytest.raises(certkv.CorruptError):
        kvdump.read(path)
    damaged = bytearray(data)
    damaged[12] = 0xFF  # inside the JSON header
    path.write_bytes(bytes(damaged))
    with pytest.raises(certkv.CorruptError):
        kvdump.read(path)
    damaged = bytearray(data)
    damaged[0:8] = (1 << 40).to_bytes(8, "little")  # a header length past the file
    path.write_bytes(bytes(damaged))
    with pytest.raises(certkv.CorruptError):
        kvdump.read(path)
    path.write_bytes(b"")
    with pytest.raises(certkv.CorruptError):
        kvdump.read(path)


def test_missing_file_raises_not_found(tmp_path):
    with pytest.raises(certkv.NotFoundError, match="nothing.safetensors"):
        kvdump.read(tmp_path / "nothing.safetensors")
    with pytest.raises(FileNotFoundError):
        kvdump.read_safetensors(tmp_path / "nothing.safetensors")


def test_safetensors_that_are_not_kv_dumps_raise_corrupt(tmp_path):
    path = tmp_path / "other.safetensors"
    kvdump.write_safetensors(path, {"x": np.zeros(3, np.float32)}, {"format": "something-else"})
    with pytest.raises(certkv.CorruptError, match="metadata 'format' is 'something-else'"):
        kvdump.read(path)
    tensors, metadata = kvdump.read_safetensors(written(tmp_path))
    del tensors["layer3.v"]
    kvdump.write_safetensors(path, tensors, metadata)
    with pytest.raises(certkv.CorruptError, match="no tensor 'layer3.v'"):
        kvdump.read(path)
    tensors, metadata = kvdump.read_safetensors(written(tmp_path))
    kvdump.write_safetensors(path, {**tensors, "layer0.k": ("BF16", tensors["layer0.k"][:, :4])}, metadata)
    with pytest.raises(certkv.CorruptError, match=r"layer0.k: expected uint16 \(2, 5, 8\)"):
        kvdump.read(path)
    tensors, metadata = kvdump.read_safetensors(written(tmp_path))
    kvdump.write_safetensors(path, {k: ("BF16", v) if v.dtype == np.uint16 else v for k, v in tensors.items()},
                             {**metadata, "n_tokens": "6"})
    with pytest.raises(certkv.CorruptError, match="metadata 'n_tokens' = '6', but the tensors have 5"):
        kvdump.read(path)


def test_bad_input_names_the_argument(tmp_path):
    dump = small_dump()
    with pytest.raises(TypeError, match="path: expected a str"):
        kvdump.read(3)
    with pytest.raises(TypeError, match="dump: expected a certkv.kvdump.KvDump"):
        kvdump.write(tmp_path / "x", {"k": 1})
    dump.v[3] = dump.v[3][:, :2]
    with pytest.raises(ValueError, match=r"dump: layer3.v: expected uint16 \(2, 5, 8\)"):
        kvdump.write(tmp_path / "x", dump)
    with pytest.raises(TypeError, match="no safetensors dtype for complex64"):
        kvdump.write_safetensors(tmp_path / "x", {"z": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="dtype 'BF16' does not hold float32"):
        kvdump.write_safetensors(tmp_path / "x", {"z": ("BF16", np.zeros(2, np.float32))})
    with pytest.raises(TypeError, match="metadata: expected str keys and values"):
        kvdump.write_safetensors(tmp_path / "x", {}, {"n": 3})
