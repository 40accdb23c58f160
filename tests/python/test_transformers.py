"""certkv.transformers on CPU with a small Llama that conftest.py makes (random weights saved as
safetensors and loaded by transformers itself, head_dim 64, bf16): CertkvCache("gaac") greedy
tokens equal to DynamicCache's on every prompt (batch 1 and a left-padded batch), dither8's
teacher-forced KL against DynamicCache and its certificate, crop against a fresh prefill, sparse
decode through the cache, and refusals. Skipped where torch or transformers is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import certkv.transformers as ct  # noqa: E402  (after the skips)
from conftest import TINY_LLAMA_PROMPTS as PROMPTS  # noqa: E402
from conftest import greedy, kl_per_position, load_tiny_llama, teacher_forced_logits  # noqa: E402


@pytest.fixture(scope="module")
def sdpa_model(tiny_llama_dir):
    return load_tiny_llama(tiny_llama_dir, "sdpa")


@pytest.fixture(scope="module")
def certkv_model(tiny_llama_dir):
    return load_tiny_llama(tiny_llama_dir, ct.ATTENTION_NAME)


def test_gaac_greedy_equals_dynamic_cache(sdpa_model, certkv_model):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want = greedy(sdpa_model, ids, transformers.DynamicCache(config=sdpa_model.config))
        cache = ct.CertkvCache(certkv_model.config, scheme="gaac")
        got = greedy(certkv_model, ids, cache)
        assert got.tolist() == want.tolist(), f"prompt of {len(prompt)} tokens"
        cert = cache.certificate()
        assert cert["scheme"] == "gaac" and cert["metered"] is False
        assert cert["kv_tokens"] == len(prompt) + 15  # the last token is not fed back
    # The longest prompt filled complete blocks: GAAC slots, in fewer bytes than bf16.
    assert cert["kv_bytes_by_class"].get("gaac", 0) > 0


def test_gaac_batch_with_left_padding(sdpa_model, certkv_model):
    a, b = PROMPTS[2], PROMPTS[1]
    ids = torch.tensor([a, [0] * (len(a) - len(b)) + b])
    mask = torch.tensor([[1] * len(a), [0] * (len(a) - len(b)) + [1] * len(b)])
    want = greedy(sdpa_model, ids, transformers.DynamicCache(config=sdpa_model.config), attention_mask=mask)
    cache = ct.CertkvCache(certkv_model.config, scheme="gaac")
    got = greedy(certkv_model, ids, cache, attention_mask=mask)
    assert got.tolist() == want.tolist()
    assert cache.store.length(0, 3) == len(a) + 15 and cache.store.length(1, 3) == len(b) + 15  # no padding stored


def test_gaac_pages_under_another_attention(sdpa_model):
    # With sdpa the cache hands the model the K and V its pages hold: lossless for gaac.
    ids = torch.tensor([PROMPTS[2]])
    want = greedy(sdpa_model, ids, transformers.DynamicCache(config=sdpa_model.config))
    got = greedy(sdpa_model, ids, ct.CertkvCache(sdpa_model.config, scheme="gaac"))
    assert got.tolist() == want.tolist()


def test_dither8_kl_and_certificate(sdpa_model, certkv_model):
    tokens = [int(x) for x in np.random.default_rng(7).integers(3, 500, 112)]
    want = teacher_forced_logits(sdpa_model, tokens, transformers.DynamicCache(config=sdpa_model.config), 48)
    cache = ct.CertkvCache(certkv_model.config, scheme="dither8")
    got = teacher_forced_logits(certkv_model, tokens, cache, 48)
    kl = kl_per_position(want, got).mean().item()
    assert kl <= 5e-3
    cert = cache.certificate()
    steps = len(tokens) - 48 - 1
    assert cert["metered"] and cert["tier"] == "B" and "note" in cert
    assert cert["cells"] == 4 * 4 * steps  # layers x query heads x decode steps
    assert cert["meter_max"] > 0 and cert["meter_p99"] <= cert["meter_max"]
    assert 0 <= cert["coverage"] <= 1
    assert cert["kv_bytes_by_class"].get("dither8", 0) > 0


def test_gate_repairs_in_the_cache(sdpa_model, certkv_model):
    # kivi2 pages (2-bit) with a tight tau: the gate must fire, repair from the backing store, and
    # bring the teacher-forced logits closer to DynamicCache's than the same pages ungated.
    tokens = [int(x) for x in np.random.default_rng(8).integers(3, 500, 96)]
    want = teacher_forced_logits(sdpa_model, tokens, transformers.DynamicCache(config=sdpa_model.config), 48)
    kl, certs = {}, {}
    for gate in (False, True):
        cache = ct.CertkvCache(certkv_model.config, scheme="kivi2", gate=gate, meter_tau=0.02, recent_window_tokens=0)
        got = teacher_forced_logits(certkv_model, tokens, cache, 48)
        kl[gate] = kl_per_position(want, got).mean().item()
        certs[gate] = cache.certificate()
    assert certs[False]["gate_repairs"] == 0 and certs[False]["coverage"] < 1
    assert certs[True]["gate_repairs"] > 0 and certs[True]["pagein_bytes"] > 0
    assert kl[True] < kl[False]


def test_crop_equals_a_fresh_prefill(certkv_model, sdpa_model):
    # Lossless schemes: bit for bit. (dither8 chooses each layer's outlier pairs from its first
    # rows, so a fresh prefill of fewer rows may choose others: not compared bit for bit.)
    tokens = PROMPTS[2]
    for scheme in ("bf16", "gaac"):
        cache = ct.CertkvCache(certkv_model.config, scheme=scheme)
        with torch.no_grad():
            certkv_model(input_ids=torch.tensor([tokens]), past_key_values=cache)
            cache.crop(-7)
            assert cache.get_seq_length() == len(tokens) - 7
            cropped = certkv_model(input_ids=torch.tensor([[tokens[-7]]]), past_key_values=cache).logits[0, -1]
            fresh_cache = ct.CertkvCache(certkv_model.config, scheme=scheme)
            certkv_model(input_ids=torch.tensor([tokens[:-7]]), past_key_values=fresh_cache)
            fresh = certkv_model(input_ids=torch.tensor([[tokens[-7]]]), past_key_values=fresh_cache).logits[0, -1]
        assert torch.equal(cropped, fresh), scheme
    # And against DynamicCache's crop: the same next token, for gaac and dither8.
    dyn = transformers.DynamicCache(config=sdpa_model.config)
    with torch.no_grad():
        sdpa_model(input_ids=torch.tensor([tokens]), past_key_values=dyn)
        dyn.crop(-7)
        want = sdpa_model(input_ids=torch.tensor([[tokens[-7]]]), past_key_values=dyn).logits[0, -1]
        cache = ct.CertkvCache(certkv_model.config, scheme="dither8")
        certkv_model(input_ids=torch.tensor([tokens]), past_key_values=cache)
        cache.crop(-7)
        lossy = certkv_model(input_ids=torch.tensor([[tokens[-7]]]), past_key_values=cache).logits[0, -1]
    assert cache.get_seq_length() == dyn.get_seq_length() == len(tokens) - 6
    assert int(want.argmax()) == int(cropped.argmax()) == int(lossy.argmax())


def test_sparse_decode_through_the_cache(certkv_model):
    """CertkvCache(sparse=...) passes the sparse options to its store. Teacher forced over a
    prompt: at p = 1 each decode step attends every token (dense attention in another summation
    order: the logits within float rounding of the dense cache's, the same next tokens); at p = 0.5
    the steps past the window attend fewer tokens, and the certificate says how many."""
    tokens = PROMPTS[2]
    spec = {"window": 8, "dense_layers": 0}
    dense = teacher_forced_logits(certkv_model, tokens, ct.CertkvCache(certkv_model.config, scheme="gaac"), 8)
    full_cache = ct.CertkvCache(certkv_model.config, scheme="gaac", sparse={"p": 1.0, **spec})
    full = teacher_forced_logits(certkv_model, tokens, full_cache, 8)
    assert (full - dense).abs().max().item() <= 1e-4 * dense.abs().max().item()
    assert torch.equal(full.argmax(-1), dense.argmax(-1))
    assert full_cache.store.sparse_stats()["mean_budget"] == 1.0
    half_cache = ct.CertkvCache(certkv_model.config, scheme="gaac", sparse={"p": 0.5, **spec})
    half = teacher_forced_logits(certkv_model, tokens, half_cache, 8)
    assert torch.isfinite(half).all()
    cert = half_cache.certificate()
    assert cert["sparse"]["p"] == 0.5 and cert["sparse"]["cells"] > 0 and cert["sparse"]["mean_budget"] < 1.0


def test_batch_repeat_interleave_and_select_indices(sdpa_model, certkv_model):
    """One prompt prefilled once, its cache repeated for three samples (the copies share its
    pages), each fed its own next tokens, then rows selected. Every step's logits equal those of
    a cache that prefilled the prompt three times over and never selected (its rows' own pages),
    and pick DynamicCache's next tokens doing the same."""
    prompt = PROMPTS[2]
    ids = torch.tensor([prompt])
    dynamic = transformers.DynamicCache(config=sdpa_model.config)
    cache = ct.CertkvCache(certkv_model.config, scheme="gaac")
    plain = ct.CertkvCache(certkv_model.config, scheme="gaac")

    def step(tokens, rows):
        want = sdpa_model(input_ids=tokens, past_key_values=dynamic).logits[:, -1].float()
        got = certkv_model(input_ids=tokens, past_key_values=cache).logits[:, -1].float()
        ref = certkv_model(input_ids=tokens, past_key_values=plain).logits[rows, -1].float()
        assert torch.equal(got, ref)
        assert torch.equal(want.argmax(-1), got.argmax(-1))

    with torch.no_grad():
        sdpa_model(input_ids=ids, past_key_values=dynamic)
        certkv_model(input_ids=ids, past_key_values=cache)
        certkv_model(input_ids=ids.repeat(3, 1), past_key_values=plain)
        pages = sum(cache.store.kv_stats()["pages_by_class"].values())
        dynamic.batch_repeat_interleave(3)
        cache.batch_repeat_interleave(3)
        assert cache.store.n_sequences == 3 and sum(cache.store.kv_stats()["pages_by_class"].values()) == pages
        step(torch.tensor([[7], [8], [9]]), [0, 1, 2])
        step(torch.tensor([[10], [11], [12]]), [0, 1, 2])
        # The rows differ now: keep the third and the first, in that order, and go on.
        dynamic.batch_select_indices(torch.tensor([2, 0]))
        cache.batch_select_indices(torch.tensor([2, 0]))
        assert [cache.store.length(i, 0) for i in range(2)] == [len(prompt) + 2] * 2
        # The plain cache keeps every row: its rows 2 and 0 are fed the same tokens, row 1 any.
        want = sdpa_model(input_ids=torch.tensor([[13], [14]]), past_key_values=dynamic).logits[:, -1].float()
        got = certkv_model(input_ids=torch.tensor([[13], [14]]), past_key_values=cache).logits[:, -1].float()
        ref = certkv_model(input_ids=torch.tensor([[14], [5], [13]]), past_key_values=plain).logits[[2, 0], -1].float()
        assert torch.equal(got, ref)
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        # A boolean mask, as DynamicCache's keys[indices] takes one.
        cache.batch_select_indices(torch.tensor([False, True]))
        assert cache.store.n_sequences == 1 and cache.store.length(0, 0) == len(prompt) + 3
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)
    with pytest.raises(IndexError, match="holds 1 rows"):
        cache.batch_select_indices(torch.tensor([1]))
    with pytest.raises(ValueError, match="no row would be left"):
        cache.batch_select_indices(torch.tensor([], dtype=torch.long))


def test_refusals(certkv_model):
    cache = ct.CertkvCache(certkv_model.config, scheme="gaac")
    k = torch.zeros((1, 2, 3, 64), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="key_states: expected bfloat16, float16 or float32"):
        cache.update(k.to(torch.int32), k.to(torch.int32), 0)
    with pytest.raises(ValueError, match=r"key_states: expected shape \[batch, 2, n_tokens, 64\]"):
        cache.update(torch.zeros((1, 3, 3, 64), dtype=torch.bfloat16), k, 0)
    with pytest.raises(ValueError, match="scheme: unknown KV scheme 'int3'"):
        ct.CertkvCache(certkv_model.config, scheme="int3")
    with pytest.raises(RuntimeError, match="needs past_key_values=CertkvCache"):
        with torch.no_grad():
            certkv_model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    with pytest.raises(ValueError, match="device: CertkvCache takes the device"):
        ct.CertkvCache(certkv_model.config, scheme="gaac", device="cuda")
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"value_states: expected a tensor on cpu.*got meta"):
        cache.update(k, k.to("meta"), 1)
