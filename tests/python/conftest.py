"""Shared fixtures: one load of the default model (SmolLM2-135M-Instruct, models/ of the checkout
or $CERTKV_MODEL) for the whole session, and the small Llama of the transformers tests (CPU and
CUDA), made once."""

import numpy as np
import pytest

import certkv

PROMPT = "Write one sentence about the sea."

# Token ids for tiny_llama_dir's model.
TINY_LLAMA_PROMPTS = [[5, 17, 250, 3, 99], list(range(30, 53)),
                      [int(x) for x in np.random.default_rng(1).integers(3, 500, 40)]]


@pytest.fixture(scope="session")
def model() -> certkv.Model:
    return certkv.Model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 4-layer Llama with random weights (head_dim 64, 4 query and 2 KV heads), saved as
    safetensors for transformers to load. Skips where torch or transformers is not installed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # sharper attention than at initialization, so that KV errors show
            layer.self_attn.q_proj.weight.mul_(2)
            layer.self_attn.k_proj.weight.mul_(2)
        model.lm_head.weight.mul_(20)  # well separated logits: greedy ties are not the question
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_tiny_llama(model_dir, attn, device="cpu", dtype=None):
    """tiny_llama_dir's model loaded by transformers in `dtype` (default bf16) with attention `attn`,
    on `device`."""
    import torch
    import transformers
    m = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.bfloat16,
                                                      attn_implementation=attn)
    return m.to(device).eval()


def greedy(model, ids, cache, n=16, attention_mask=None):
    """The n tokens greedy generation appends to ids, on the CPU."""
    import torch
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].cpu()


def teacher_forced_logits(model, tokens, cache, prompt_tokens, device="cpu"):
    """The next-token logits (float32, on the CPU) of the prompt tokens[:prompt_tokens] in one call,
    then of each following token fed one at a time: [len(tokens) - prompt_tokens, vocab]."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens[:prompt_tokens]], device=device), past_key_values=cache,
                    use_cache=True)
        logits = [out.logits[0, -1].float()]
        for t in tokens[prompt_tokens:-1]:
            out = model(input_ids=torch.tensor([[t]], device=device), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits).cpu()


def kl_per_position(want, got):
    """KL(softmax(want) || softmax(got)) of each row of two logit matrices."""
    import torch
    log_p, log_q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)
