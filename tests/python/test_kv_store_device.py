"""certkv.KvStore's device argument and its device-memory calls, as far as a machine without a GPU
sees them: a cuda store refused by a build without the CUDA backend (or a machine without a
device), schemes the device does not serve refused by name, a cpu store refusing device pointers
(certkv.InvalidArgumentError from the C API), and the Python layer's checks of every argument.
The device path itself: tests/python/test_transformers_cuda.py."""

import pytest

import certkv

SHAPE = dict(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=64)


def test_cuda_store_without_a_cuda_device():
    try:
        certkv.KvStore("bf16", device="cuda", **SHAPE)
    except certkv.UnsupportedError as e:
        assert "CUDA" in str(e)
    else:
        pytest.skip("this build of certkv has the CUDA backend and this machine a CUDA device")


@pytest.mark.parametrize("scheme", ["kivi2", "rtn4"])
def test_schemes_the_device_does_not_serve_are_named(scheme):
    with pytest.raises(certkv.UnsupportedError, match=rf"{scheme} is not served on device cuda"):
        certkv.KvStore(scheme, device="cuda", **SHAPE)


def test_sparse_decode_on_the_device_reads_bf16_pages():
    with pytest.raises(certkv.UnsupportedError, match="sparse decode on device cuda reads bf16 pages, not fp8-e4m3"):
        certkv.KvStore("fp8-e4m3", device="cuda", sparse=0.9, **SHAPE)


def test_device_and_stream_arguments():
    with pytest.raises(ValueError, match="device: expected one of cpu, cuda.*'gpu'"):
        certkv.KvStore("bf16", device="gpu", **SHAPE)
    with pytest.raises(ValueError, match="device: expected one of cpu, cuda.*'cuda:1'"):
        certkv.KvStore("bf16", device="cuda:1", **SHAPE)
    with pytest.raises(ValueError, match="cuda_stream: only with device 'cuda'"):
        certkv.KvStore("bf16", cuda_stream=0, **SHAPE)
    with pytest.raises(TypeError, match="cuda_stream: expected an int"):
        certkv.KvStore("bf16", device="cuda", cuda_stream=1.5, **SHAPE)
    with pytest.raises(ValueError, match="cuda_stream: expected an int >= 0"):
        certkv.KvStore("bf16", device="cuda", cuda_stream=-1, **SHAPE)
    store = certkv.KvStore("bf16", **SHAPE)
    assert store.device == "cpu" and store.cuda_stream is None


def test_a_cpu_store_refuses_device_pointers():
    store = certkv.KvStore("bf16", n_sequences=2, **SHAPE)
    # The pointers are never dereferenced: the C API refuses the store before reading them.
    with pytest.raises(certkv.InvalidArgumentError, match="append_device: the store's device is cpu"):
        store.append_device(0, [0, 1], [3, 4], 256, 512)
    with pytest.raises(certkv.InvalidArgumentError, match="attend_device: the store's device is cpu"):
        store.attend_device(0, [1], 256, 512)
    with pytest.raises(certkv.InvalidArgumentError, match="attend_device: the store's device is cpu"):
        store.attend_device(0, [0, 1], 256, 512, meters_ptr=768)
    with pytest.raises(certkv.InvalidArgumentError, match="note_queries_device: the store's device is cpu"):
        store.note_queries_device(0, [0], [3], 256)
    with pytest.raises(certkv.InvalidArgumentError, match="finish_planned_device: the store's device is cpu"):
        store.finish_planned_device()
    # A failed finish leaves the Python side's plan as the store's: none on a cpu store.
    assert store.planned_sequences == 0 and not store._store.planned_device()
    assert store.length(0, 0) == 0 and store.length(1, 0) == 0


def test_device_call_arguments():
    store = certkv.KvStore("bf16", n_sequences=2, **SHAPE)
    with pytest.raises(TypeError, match="seqs: expected a sequence of ints, got int"):
        store.append_device(0, 0, [3], 256, 512)
    with pytest.raises(TypeError, match=r"seqs\[1\]: expected an int, got float"):
        store.append_device(0, [0, 1.0], [3, 3], 256, 512)
    with pytest.raises(TypeError, match="n_tokens: expected a sequence of ints, got str"):
        store.append_device(0, [0], "3", 256, 512)
    with pytest.raises(ValueError, match=r"n_tokens\[0\]: expected an int >= 1, got 0"):
        store.append_device(0, [0], [0], 256, 512)
    with pytest.raises(ValueError, match="n_tokens: expected 2 counts"):
        store.append_device(0, [0, 1], [3], 256, 512)
    with pytest.raises(ValueError, match="seqs: expected at least one entry"):
        store.attend_device(0, [], 256, 512)
    with pytest.raises(TypeError, match="layer: expected an int"):
        store.append_device("0", [0], [3], 256, 512)
    with pytest.raises(TypeError, match="k_ptr: expected an int, got NoneType"):
        store.append_device(0, [0], [3], None, 512)
    with pytest.raises(ValueError, match="v_ptr: expected an int >= 1, got 0"):
        store.append_device(0, [0], [3], 256, 0)
    with pytest.raises(TypeError, match="q_ptr: expected an int, got float"):
        store.attend_device(0, [0], 256.0, 512)
    with pytest.raises(ValueError, match="out_ptr: expected an int >= 1"):
        store.attend_device(0, [0], 256, 0)
    with pytest.raises(ValueError, match="meters_ptr: expected an int >= 0"):
        store.attend_device(0, [0], 256, 512, -8)
    with pytest.raises(ValueError, match="n_tokens: expected 1 counts"):
        store.note_queries_device(0, [0], [3, 4], 256)
    with pytest.raises(ValueError, match=r"n_tokens\[0\]: expected an int >= 1, got 0"):
        store.note_queries_device(0, [0], [0], 256)
    with pytest.raises(ValueError, match="q_ptr: expected an int >= 1, got 0"):
        store.note_queries_device(0, [0], [3], 0)
    # The native layer checks the counts again.
    with pytest.raises(ValueError, match="n_tokens: expected one count per entry of seqs"):
        store._store.append_device(0, [0], [1, 2], 256, 512)
    with pytest.raises(ValueError, match="n_tokens: expected one count per entry of seqs"):
        store._store.note_queries_device(0, [0], [1, 2], 256)
