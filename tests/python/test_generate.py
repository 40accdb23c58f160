"""certkv.Model, Session and Engine on the default model: text, certificates, streaming."""

from pathlib import Path

import pytest

import certkv

from conftest import PROMPT


def test_version_and_schemes():
    assert certkv.__version__.count(".") == 2
    names = [s["name"] for s in certkv.kv_schemes()]
    assert {"bf16", "gaac", "fp8-e4m3", "dither8"} <= set(names)


def test_model_info_and_tokens(model):
    info = model.info
    assert info["n_layers"] == 30 and info["head_dim"] == 64 and info["rope_layout"] in ("interleaved", "half-split")
    tokens = model.tokenize("The sea.", add_special=False)
    assert model.detokenize(tokens) == "The sea."
    turn = "<|im_start|>user\nHi<|im_end|>"
    marked = model.tokenize(turn, add_special=False, parse_special=True)
    assert len(marked) < len(model.tokenize(turn, add_special=False))
    assert model.detokenize(marked, render_special=True) == turn
    assert model.detokenize(marked) == "user\nHi"
    with pytest.raises(certkv.InvalidArgumentError, match=r"tokens\[1\]"):
        model.detokenize([tokens[0], -3])


def test_session_lossy_generate_has_a_certificate(model):
    session = certkv.Session(model, kv="fp8-e4m3")
    result = session.generate(PROMPT, max_tokens=8)
    assert result.text.strip()
    assert result.generated_tokens == 8 and result.finish_reason == "length"
    cert = result.certificate
    assert cert["scheme"] == "fp8-e4m3" and cert["metered"] and cert["tier"] == "A"
    assert cert["cells"] > 0 and 0.0 <= cert["coverage"] <= 1.0
    assert 0.0 <= cert["meter_p99"] <= cert["meter_max"] <= 1.0
    assert cert["kv_bytes_by_class"]["lossy"] > 0


def test_session_stream_yields_the_generated_text(model):
    session = certkv.Session(model, kv="dither8")
    generated = session.generate(PROMPT, max_tokens=10)
    pieces = list(session.stream(PROMPT, max_tokens=10))
    assert len(pieces) > 1 and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == generated.text
    assert session.certificate()["tier"] == "B"


def test_session_prefill_decode_logits(model):
    session = certkv.Session(model)
    logits = session.prefill(model.tokenize(PROMPT))
    assert logits.shape == (model.info["n_vocab"],) and logits.dtype.name == "float32"
    session.decode(int(logits.argmax()))
    assert session.n_past == len(model.tokenize(PROMPT)) + 1
    assert not session.certificate()["metered"]


def test_engine_batch_matches_alone_and_streams(model):
    engine = certkv.Engine(model, kv="dither8", gate=True, max_sequences=2)
    results = engine.generate([PROMPT, "Name a colour."], max_tokens=8)
    assert all(r.text and r.finish_reason == "length" for r in results)
    cert = results[0].certificate
    assert cert["metered"] and cert["tier"] == "B" and cert["tau"] == pytest.approx(0.2)
    assert cert["meter_max"] <= 1.0 and cert["kv_bytes_by_class"]["dither8"] > 0
    # Streaming the same prompt on the same engine gives the same text: it shares the first
    # request's prompt blocks as they were computed, not as the gate repaired them.
    assert "".join(engine.stream(PROMPT, max_tokens=8)) == results[0].text
    assert engine.last_result.text == results[0].text
    assert engine.last_result.certificate == cert


def test_engine_logprobs(model):
    engine = certkv.Engine(model, max_sequences=2)
    r = engine.generate("The sea is", max_tokens=5, chat=False, logprobs=3, prompt_logprobs=True,
                        ignore_end=True)
    assert len(r.logprobs) == r.generated_tokens == 5
    assert len(r.prompt_logprobs) == r.prompt_tokens - 1
    for e in r.logprobs:  # greedy: each token is its position's most likely
        assert e.logprob <= 0 and len(e.top) == 3 and e.top[0] == (e.token, e.logprob)
        assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]
    assert model.detokenize([e.token for e in r.logprobs]) == r.text
    prompt = model.tokenize("The sea is", add_special=True)
    assert [e.token for e in r.prompt_logprobs] == prompt[1:]
    plain = engine.generate("The sea is", max_tokens=2, chat=False)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    # Asked for, without the prompt's: a list for the tokens, None for the prompt.
    only = engine.generate("The sea is", max_tokens=2, chat=False, logprobs=0, ignore_end=True)
    assert len(only.logprobs) == 2 and only.logprobs[0].top == [] and only.prompt_logprobs is None
    with pytest.raises(ValueError, match="logprobs: expected None or an integer in"):
        engine.submit("x", logprobs=21)


def test_engine_stream_abandoned_is_cancelled(model):
    engine = certkv.Engine(model, max_sequences=1)
    stream = engine.stream(PROMPT, max_tokens=32)
    next(stream)
    stream.close()
    assert engine.last_result.finish_reason == "cancelled"


def test_sparse_option_reaches_the_session(model):
    session = certkv.Session(model, sparse={"p": 0.9, "window": 16, "dense_layers": 2})
    session.generate(PROMPT, max_tokens=4)
    assert session.certificate()["sparse"]["p"] == pytest.approx(0.9)


def test_meter_audit_checks_every_cell(model, tmp_path):
    """Session.audit: the true total variation of every metered decode step's (layer, head) cell
    against its meter; none is below it, and per layer the cells add up to the total."""
    session = certkv.Session(model, kv="fp8-e4m3")
    session.audit(dump_cells=4, seed=7)
    session.generate(PROMPT, max_tokens=6)
    stats = session.audit_stats()
    info = model.info
    assert stats["cells"] == 5 * info["n_layers"] * info["n_heads"]  # the decode steps after the first token
    assert stats["violations"] == 0 and stats["worst_margin"] < 0
    assert 0.0 < stats["max_tv"] <= stats["max_meter"] <= 1.0
    assert stats["tightness_q50"] >= 1.0  # meter / TV: a bound
    assert len(stats["layers"]) == info["n_layers"]
    assert sum(layer["cells"] for layer in stats["layers"]) == stats["cells"]
    path = tmp_path / "cells.safetensors"
    session.audit_dump(path)
    header = path.read_bytes()
    assert int.from_bytes(header[:8], "little") > 0 and b"cell0.k_hat" in header
    with pytest.raises(certkv.InvalidArgumentError, match="audit needs a metered session"):
        certkv.Session(model, kv="gaac").audit()
    with pytest.raises(ValueError, match="dump_cells: expected an int >= 0"):
        session.audit(dump_cells=-1)


def test_sparse_audit_measures_recall(model):
    """Session.sparse_audit: recall and budget of the sparse steps, per layer, and another Top-p
    rule on the same cells (p = 1 recalls everything)."""
    session = certkv.Session(model, sparse={"p": 0.9, "window": 16, "dense_layers": 2})
    session.sparse_audit(rules=[1.0, (0.5, 1.0)])
    text = " ".join(["The sea was calm and the ship sailed on through the grey morning light."] * 20)
    session.generate(text, max_tokens=4, chat=False)
    stats = session.sparse_audit_stats()
    assert stats["cells"] > 0 and 0.0 < stats["mean_budget"] < 1.0 and 0.0 < stats["mean_recall"] <= 1.0
    assert len(stats["layers"]) == model.info["n_layers"]
    assert stats["layers"][0]["cells"] == 0 and stats["layers"][5]["cells"] > 0  # the dense layers
    assert len(stats["rules"]) == 2
    assert stats["rules"][0]["cells"] == stats["cells"] and stats["rules"][0]["mean_recall"] == pytest.approx(1.0)
    assert stats["rules"][1]["mean_budget"] <= stats["rules"][0]["mean_budget"]
    with pytest.raises(certkv.InvalidArgumentError, match="needs a sparse session"):
        certkv.Session(model).sparse_audit()
    with pytest.raises(TypeError, match=r"rules\[0\]: expected p or \(p, deviations\)"):
        certkv.Session(model, sparse=0.9).sparse_audit(rules=["0.5"])


def test_a_conversation_of_several_turns(model):
    """A list of messages goes through the model's chat template: one user turn is the plain
    prompt's chat form, and a longer conversation carries every turn before the next reply."""
    one = [{"role": "user", "content": PROMPT}]
    assert model.chat_template(one) == model.chat_prompt(PROMPT)
    session = certkv.Session(model)
    assert session.generate(one, max_tokens=6).text == session.generate(PROMPT, max_tokens=6).text
    turns = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a sea."},
             {"role": "assistant", "content": "The Baltic."}, {"role": "user", "content": "And a river?"}]
    text = model.chat_template(turns)
    assert all(m["content"] in text for m in turns)
    assert text.index("Name a sea.") < text.index("The Baltic.") < text.index("And a river?")
    bare = model.chat_template(turns, add_generation_prompt=False)
    assert text.startswith(bare) and len(text) > len(bare)  # the assistant's header follows
    result = session.generate(turns, max_tokens=6)
    assert result.prompt_tokens == len(model.tokenize(text, parse_special=True))
    engine = certkv.Engine(model, max_sequences=1)
    assert engine.generate(turns, max_tokens=6).text == result.text  # one conversation, not a batch
    with pytest.raises(ValueError, match=r"messages\[1\]: role 'robot' is not one of system, user, assistant"):
        model.chat_template([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match="put the system message in the list"):
        session.generate(one, system="Be brief.")
    with pytest.raises(TypeError, match="messages: expected a non-empty list"):
        model.chat_template([])
    # Text the C API takes NUL-terminated is refused with a NUL inside, never cut short.
    with pytest.raises(ValueError, match=r"messages\[0\].content: contains a NUL"):
        model.chat_template([{"role": "user", "content": "before\0after"}])
    with pytest.raises(ValueError, match="prompt: contains a NUL"):
        session.generate("before\0after", max_tokens=1)
    with pytest.raises(ValueError, match="stop: contains a NUL"):
        engine.submit("a", stop=["x\0y"])
    assert model.tokenize("a\0b", add_special=False)  # tokenize takes a length: a NUL is text


def test_llama2c_checkpoint_with_its_tokenizer():
    """Model(path, tokenizer=...) loads a llama2.c checkpoint (the repository's stories260K)."""
    data = Path(__file__).resolve().parents[1] / "data" / "models"
    model = certkv.Model(data / "stories260K.bin", tokenizer=data / "tok512.bin")
    assert model.info["n_layers"] == 5 and model.info["n_vocab"] == 512 and model.tokenizer.endswith("tok512.bin")
    result = certkv.Session(model).generate("Once upon a time", max_tokens=12, chat=False)  # bf16 pages
    assert result.generated_tokens == 12 and result.text.strip()
    with pytest.raises(certkv.NotFoundError, match="missing.bin"):
        certkv.Model(data / "stories260K.bin", tokenizer=data / "missing.bin")


def test_device_stats_on_the_cpu(model):
    stats = certkv.Session(model).device_stats()
    assert stats["on_device"] is False and stats["attention_calls"] == 0


def test_bad_options_raise_with_the_reason(model):
    with pytest.raises(ValueError, match="unknown KV scheme 'fp7'.*dither8"):
        certkv.Session(model, kv="fp7")
    with pytest.raises(ValueError, match="gate: applies to lossy schemes"):
        certkv.Session(model, kv="bf16", gate=True)
    with pytest.raises(ValueError, match="sparse"):
        certkv.Session(model, sparse={"q": 0.9})
    with pytest.raises(certkv.InvalidArgumentError):
        certkv.Session(model, kv="dither8", tau=-1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        certkv.Session(model).generate(PROMPT, max_tokens=0)
    with pytest.raises(TypeError, match="prompt"):
        certkv.Session(model).generate(3.5)
    for cls in (certkv.Session, certkv.Engine):
        with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda', got 'gpu'"):
            cls(model, device="gpu")
        # kivi2 has no device route: refused by the scheme table where the build has CUDA, by the
        # build where it has not; never served on the CPU instead.
        with pytest.raises(certkv.UnsupportedError, match="kivi2|CUDA"):
            cls(model, kv="kivi2", device="cuda")


def test_missing_model_names_the_file():
    with pytest.raises(certkv.NotFoundError, match="/nonexistent/model.gguf") as info:
        certkv.Model("/nonexistent/model.gguf")
    assert isinstance(info.value, FileNotFoundError) and info.value.status == "not found"
