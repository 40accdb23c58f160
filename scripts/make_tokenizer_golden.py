#!/usr/bin/env python3
"""Writes the expected outputs that src/model/tokenizer_test.cc compares against:

  tests/golden/tokenizer_smollm2.json  SmolLM2-135M-Instruct (byte-level BPE, pre "smollm")
  tests/golden/tokenizer_llama2.json   llama-2-tiny-random (SentencePiece, 32000 pieces)

Token ids come from llama.cpp through llama-cpp-python (Llama(vocab_only=True).tokenize), the
implementation certkv's tokenizer follows. For the SmolLM2 vocabulary the same cases are also
tokenized with other pre-tokenizers (a copy of its tokenizer metadata with tokenizer.ggml.pre
changed), so that every pre-tokenizer certkv supports is checked against llama.cpp. Chat prompts
come from rendering the Hugging Face Jinja templates with jinja2 the way transformers does
(trim_blocks, lstrip_blocks).

The corpus passages are cut from the full books of ../shared/data/corpus (--shared) and stored
with their text in the golden files, so that the tests need no book; llama-2-tiny-random.gguf is
the repository's test fixture (tests/data/models).

Needs: pip install llama-cpp-python gguf jinja2
Run from the repository root:
  python3 scripts/make_tokenizer_golden.py [--models DIR] [--shared DIR] [--test-data DIR]
"""
import argparse
import json
import os
import tempfile

import jinja2
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from llama_cpp import Llama

CASES = [
    # name, text, add_bos, parse_special
    ("empty", "", False, True),
    ("ascii", "Hello world! This is a test of the tokenizer.", False, True),
    ("ascii_add_bos", "Hello world! This is a test of the tokenizer.", True, True),
    ("punctuation", "Wait... what?! (yes) [no] {maybe}; a-b_c/d\\e \"quoted\" 'single' #hash "
                    "@at $5 %50 ^caret &amp; *star ~tilde `tick` |pipe| <angle> --- ,,, ?!", False,
     True),
    ("numbers", "123456789 3.14 -42 1,000,000 0.001 2024-01-01 1e10 007 12345678901234567890",
     False, True),
    ("contractions", "I'm sure you'll see it's what we'd've done; they're here, we've left. "
                     "DON'T SHOUT, I'LL GO. Don't 'quote' me.", False, True),
    ("whitespace", "a  b   c\n\nd\t\te \r\n f   \n  g    ", False, True),
    ("leading_trailing_spaces", "   leading and trailing   ", False, True),
    ("newlines_only", "\n\n\n", False, True),
    ("single_space", " ", False, True),
    ("unicode_latin", "Café résumé naïve façade Ångström œuvre straße", False, True),
    ("unicode_cjk", "中文测试：你好，世界。日本語のテキスト、カタカナ。", False, True),
    ("emoji", "Smile 🙂 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷!", False, True),
    ("cyrillic", "Привет, как дела? Съешь же ещё этих мягких французских булок.", False, True),
    ("mixed_scripts", "Greek αβγ, Arabic مرحبا, Hebrew שלום, Hindi नमस्ते, Thai สวัสดี, "
                      "Korean 안녕하세요", False, True),
    ("math_symbols", "∑x² ≤ ∞ ± √2 → ∀ε>0 ½ ⅓ ① Ⅻ ٣٤٥", False, True),
    ("unicode_spaces", "a\u00a0b\u2003c\u3000d\u2028e\u0085f", False, True),
    ("control_chars", "a\x01b\x7fc\x1bd\x0ce", False, True),
    ("bytes_without_tokens", "x\x04y\x13z \U00050000! \x1d", False, True),
    ("code", "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
     False, True),
    ("regex_edges", "it's IT'S it'Ll 'x '' x'  \n\n  a\t\tb!!\n\n?? \r\n\r\nc.\n x1y2 ab3 "
                    "...\n\n\nend  \t\n", False, True),
    ("long_word", "a" * 300 + "supercalifragilisticexpialidocious" * 3, False, True),
    ("chat_special", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", False, True),
    ("chat_special_unparsed", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
     False, False),
    ("special_adjacent", "<|endoftext|><|endoftext|>text<|im_end|> <|im_start|>", False, True),
    ("llama_special", "<s>Hello</s> world<unk> end", False, True),
    ("llama_special_unparsed", "<s>Hello</s> world<unk> end", False, False),
    ("llama_special_add_bos", "<s>Hello</s> world", True, True),
]

# Every pre-tokenizer certkv implements, tried on the SmolLM2 vocabulary.
PRE_VARIANTS = ["gpt-2", "llama-bpe", "qwen2", "default"]

# (file, fraction of the way into the book) for the ~1000-byte passages.
PASSAGES = [
    ("austen-emma.txt", 0.31),
    ("austen-pride-and-prejudice.txt", 0.52),
    ("carroll-alice-in-wonderland.txt", 0.40),
    ("conrad-heart-of-darkness.txt", 0.63),
    ("dickens-tale-of-two-cities.txt", 0.27),
    ("doyle-adventures-of-sherlock-holmes.txt", 0.71),
    ("melville-moby-dick.txt", 0.45),
    ("stoker-dracula.txt", 0.58),
    ("twain-huckleberry-finn.txt", 0.36),
    ("wells-time-machine.txt", 0.50),
]
PASSAGE_BYTES = 1000
EMMA_BYTES = 2000

# Representative templates of other families (the Hugging Face templates' structure).
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": " It is 4. "},
    {"role": "user", "content": "And 3+3?\n"},
]


def render(template, messages, add_generation_prompt, bos_token=""):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            bos_token=bos_token, eos_token="")


def tokenize(llm, text, add_bos, parse_special):
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=parse_special)


def load(path):
    return Llama(model_path=path, vocab_only=True, verbose=False)


def passage_spans(shared_dir):
    spans = []
    for name, fraction in PASSAGES + [("austen-emma.txt", 0.05)]:
        data = open(os.path.join(shared_dir, "data", "corpus", name), "rb").read()
        length = EMMA_BYTES if fraction == 0.05 else PASSAGE_BYTES
        start = data.index(b"\n", int(len(data) * fraction)) + 1
        end = start + length
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # do not cut a UTF-8 sequence
            end += 1
        spans.append({"name": f"{name}@{start}", "file": name, "byte_offset": start,
                      "byte_length": end - start, "text": data[start:end].decode("utf-8")})
    return spans


def gguf_with_pre(src_path, pre, dst_path):
    """A tensor-less copy of src_path's metadata with tokenizer.ggml.pre replaced."""
    reader = GGUFReader(src_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(dst_path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if key == "tokenizer.ggml.pre":
            writer.add_string(key, pre)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        elif vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="models")
    parser.add_argument("--shared", default="../shared", help="holds data/corpus (the full books)")
    parser.add_argument("--test-data", default="tests/data", help="holds models/llama-2-tiny-random.gguf")
    parser.add_argument("--out", default="tests/golden")
    args = parser.parse_args()
    smollm_path = os.path.join(args.models, "SmolLM2-135M-Instruct.Q4_1.gguf")
    llama2_path = os.path.join(args.test_data, "models", "llama-2-tiny-random.gguf")
    spans = passage_spans(args.shared)
    reference = "llama-cpp-python " + __import__("llama_cpp").__version__ + " (vocab_only)"

    def cases_for(llm, lossy=()):
        # lossless: decoding the ids gives the text back (false where the vocabulary has no
        # token for some byte of it, which llama.cpp then drops).
        return [{"name": n, "text": t, "add_bos": b, "parse_special": s, "lossless": n not in lossy,
                 "ids": tokenize(llm, t, b, s)} for n, t, b, s in CASES]

    def passages_for(llm):
        return [{"name": p["name"], "file": p["file"], "byte_offset": p["byte_offset"],
                 "byte_length": p["byte_length"], "text": p["text"],
                 "ids": tokenize(llm, p["text"], False, False)}
                for p in spans]

    smollm = load(smollm_path)
    smollm_template = GGUFReader(smollm_path).fields["tokenizer.chat_template"]
    smollm_template = bytes(smollm_template.parts[smollm_template.data[0]]).decode("utf-8")
    hi = [{"role": "user", "content": "Hi"}]
    with_system = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    chat = [
        {"name": "smollm2_hi", "template": None, "messages": hi, "add_generation_prompt": True},
        {"name": "smollm2_conversation", "template": None, "messages": CONVERSATION,
         "add_generation_prompt": True},
        {"name": "smollm2_system", "template": None, "messages": with_system,
         "add_generation_prompt": False},
        {"name": "qwen_style_hi", "template": QWEN_STYLE_TEMPLATE, "messages": hi,
         "add_generation_prompt": True},
        {"name": "qwen_style_system", "template": QWEN_STYLE_TEMPLATE, "messages": with_system,
         "add_generation_prompt": True},
        {"name": "llama3_conversation", "template": LLAMA3_TEMPLATE, "messages": CONVERSATION,
         "add_generation_prompt": True},
        {"name": "gemma_conversation", "template": GEMMA_TEMPLATE, "messages": CONVERSATION,
         "add_generation_prompt": True},
    ]
    for c in chat:
        # BOS is the tokenizer's business, so templates are rendered with an empty bos_token.
        c["expected"] = render(c["template"] or smollm_template, c["messages"],
                               c["add_generation_prompt"])

    pre_variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_VARIANTS:
            path = os.path.join(tmp, f"smollm2-{pre}.gguf")
            gguf_with_pre(smollm_path, pre, path)
            llm = load(path)
            pre_variants[pre] = {
                "cases": {n: tokenize(llm, t, b, s) for n, t, b, s in CASES},
                "passages": {p["name"]: tokenize(llm, p["text"], False, False) for p in spans[:3]},
            }
            del llm

    os.makedirs(args.out, exist_ok=True)
    smollm_out = {
        "model_file": os.path.basename(smollm_path), "reference": reference,
        "cases": cases_for(smollm, lossy=("bytes_without_tokens",)), "passages": passages_for(smollm),
        "pre_variants": pre_variants, "chat": chat,
    }
    llama2 = load(llama2_path)
    llama2_out = {
        "model_file": os.path.basename(llama2_path), "reference": reference,
        "cases": cases_for(llama2), "passages": passages_for(llama2),
    }
    for name, obj in [("tokenizer_smollm2.json", smollm_out), ("tokenizer_llama2.json", llama2_out)]:
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=True, separators=(",", ":"))
            f.write("\n")
        print("wrote", os.path.join(args.out, name))


if __name__ == "__main__":
    main()
