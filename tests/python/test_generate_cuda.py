"""certkv.Session and certkv.Engine with device="cuda", on the default model (SmolLM2-135M-Instruct,
or $CERTKV_MODEL): the Engine's CUDA backend (the whole forward pass on the device) gives the same
greedy text over gaac pages as over bf16 pages, reports a metered certificate over fp8-e4m3 and
dither8 pages, and refuses the gate; the Session's device route generates with its certificate.
Skipped unless this build of certkv has its CUDA backend and a device is visible."""

import pytest

import certkv
from conftest import PROMPT

PROMPTS = [PROMPT, "Name three rivers of Europe.", "Count from one to ten in French."]


def cuda_available(model) -> bool:
    try:
        certkv.Session(model, kv="bf16", device="cuda", context_tokens=64)
    except certkv.UnsupportedError:
        return False
    return True


@pytest.fixture(scope="module")
def cuda_model(model):
    if not cuda_available(model):
        pytest.skip("needs certkv built with its CUDA backend and a CUDA device")
    return model


def test_engine_on_the_device_lossless_pages_give_one_text(cuda_model):
    texts = {}
    for kv in ("bf16", "gaac"):
        engine = certkv.Engine(cuda_model, kv=kv, device="cuda", max_sequences=3)
        results = engine.generate(PROMPTS, max_tokens=24)
        assert all(r.finish_reason in ("length", "end") and r.generated_tokens > 0 for r in results), kv
        texts[kv] = [r.text for r in results]
        assert results[0].certificate["metered"] is False
    assert texts["gaac"] == texts["bf16"]


@pytest.mark.parametrize("kv,tier", [("fp8-e4m3", "A"), ("dither8", "B")])
def test_engine_on_the_device_is_metered(cuda_model, kv, tier):
    engine = certkv.Engine(cuda_model, kv=kv, device="cuda", max_sequences=3)
    results = engine.generate(PROMPTS, max_tokens=16)
    for r in results:
        cert = r.certificate
        assert cert["metered"] and cert["tier"] == tier
        assert cert["cells"] > 0 and 0 <= cert["meter_max"] <= 1 and 0 <= cert["coverage"] <= 1
        assert cert["kv_bytes_by_class"]


def test_engine_on_the_device_refuses_the_gate(cuda_model):
    with pytest.raises(certkv.CertkvError, match="gate"):
        certkv.Engine(cuda_model, kv="fp8-e4m3", gate=True, device="cuda")


def test_session_device_route(cuda_model):
    session = certkv.Session(cuda_model, kv="dither8", device="cuda")
    r = session.generate(PROMPT, max_tokens=16)
    assert r.generated_tokens > 0 and r.text
    assert r.certificate["metered"] and r.certificate["tier"] == "B" and r.certificate["cells"] > 0
