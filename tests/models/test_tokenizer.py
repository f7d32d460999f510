"""Tokenizer and chat templates: same ids, text and prompts as transformers; templates run sandboxed."""
from __future__ import annotations

import json
import shutil

import pytest

from batchjob.models.chat import ChatTemplateError, render_chat
from batchjob.models.tokenizer import Tokenizer

TEXTS = [
    "In 2024 I paid 12345 dollars.",
    "Hello, world! How's it going? I'm fine; you'll see they've gone.",
    "  leading spaces, trailing spaces   \n\n\ttabs and\r\nnewlines\n",
    "def square(x: int) -> int:\n    return x ** 2  # squares\n\nprint([square(i) for i in range(10)])",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧 flag 🇫🇷",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "Naïve café résumé — “curly quotes” and ‘apostrophes’ … ÷ ×",
    "x=3.14e-10; y = [1,2,3]; z = 0xFF_FF; 1,000,000.00 and 2^64-1=18446744073709551615",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>  <|im_start|>",
    "مرحبا بالعالم Привет мир Γειά σου Κόσμε",
    "",
    " ",
    "a",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    import transformers

    folder = tiny_model_dir("llama")
    return Tokenizer.from_hf_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


# ---- SmolLM2 GGUF vocabulary ----------------------------------------------------------------------


def test_smollm2_reference_ids(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    assert tok.encode("In 2024 I paid 12345 dollars.") == [788, 216, 34, 32, 34, 36, 339, 5940, 216, 33, 34, 35, 36, 37, 8358, 30]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size, tok.add_bos_token) == (1, [2], 49152, False)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers(smollm2_loaded, smollm2_hf_tokenizer, text):
    tok, hf = smollm2_loaded.tokenizer, smollm2_hf_tokenizer
    ids = tok.encode(text)
    assert ids == hf(text).input_ids == hf.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_smollm2_non_ascii_numerals_split_like_the_original_tokenizer(smollm2_loaded, smollm2_hf_tokenizer):
    # SmolLM2's own tokenizer.json (Digits(individual) then ByteLevel) and llama.cpp's "smollm" pre-tokenizer
    # isolate every numeric character, ASCII or not. transformers' GGUF conversion skips the digit split, which
    # only shows on numerals outside ASCII: it BPE-merges the space with "½"'s first byte.
    tok = smollm2_loaded.tokenizer
    assert [tok.backend.id_to_token(i) for i in tok.encode(" ½")] == ["Ġ", "Â½"]
    assert [tok.backend.id_to_token(i) for i in smollm2_hf_tokenizer(" ½").input_ids] == ["ĠÂ", "½"]
    assert tok.decode(tok.encode("cook ½ cup, ² and ٣")) == "cook ½ cup, ² and ٣"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_smollm2_chat_template_matches_transformers(smollm2_loaded, smollm2_hf_tokenizer, chat, add_generation_prompt):
    tok = smollm2_loaded.tokenizer
    ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = smollm2_hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == smollm2_hf_tokenizer(theirs).input_ids


def test_smollm2_default_system_message(smollm2_loaded):
    prompt = smollm2_loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2_loaded.tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # special tokens kept whole


# ---- tiny HF folder and its GGUF conversion -------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_hf_folder_matches_transformers(tiny_pair, text):
    tok, hf = tiny_pair
    ids = tok.encode(text)
    assert ids == hf(text).input_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS)
def test_hf_folder_chat_template_matches_transformers(tiny_pair, chat):
    tok, hf = tiny_pair
    assert tok.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_hf_folder_special_tokens(tiny_pair):
    tok, _ = tiny_pair
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2, 0]  # tokenizer eos, then generation_config's
    assert tok.vocab_size == 400 and not tok.add_bos_token


def test_gguf_vocabulary_tokenizes_like_its_source(tiny_model_dir, tiny_gguf_path):
    from batchjob.models.loader import load_model

    hf_tok = Tokenizer.from_hf_dir(tiny_model_dir("llama"))
    gguf_tok = load_model(str(tiny_gguf_path("llama"))).tokenizer
    for text in TEXTS:
        assert gguf_tok.encode(text) == hf_tok.encode(text), text
        assert gguf_tok.decode(hf_tok.encode(text)) == hf_tok.decode(hf_tok.encode(text))
    assert gguf_tok.chat_template == hf_tok.chat_template
    assert (gguf_tok.bos_token_id, gguf_tok.eos_token_ids[0]) == (1, 2)


def test_add_bos_token_prepends_bos_once(tiny_model_dir, tmp_path):
    folder = tmp_path / "bos"
    shutil.copytree(tiny_model_dir("llama"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(folder)
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [1, *plain]
    assert tok.encode("<|im_start|>hello") == [1, *plain]  # a template that writes BOS itself gets no second one


def test_chat_template_file_wins_and_generation_config_eos(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"
    assert tok.eos_token_ids == [2, 0]


def test_no_template_is_a_clear_error(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}") == "hi"


def test_unsupported_gguf_tokenizer_is_refused():
    # SentencePiece ("llama") vocabularies: tests/models/test_gguf_spm.py
    with pytest.raises(ValueError, match="'bert' is not supported; supported: 'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ---- the sandbox ----------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
        "{{ messages.append({'role': 'x'}) }}",  # immutable sandbox: no mutating the caller's list
        "{{ messages[0].update({'content': 'pwned'}) }}",
        "{% set ns = namespace(__class__=1) %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_unsafe_access(template):
    messages = [dict(m) for m in MSG]
    with pytest.raises(ChatTemplateError):
        render_chat(template, messages)
    assert messages == MSG


def test_unsafe_attribute_renders_nothing():
    # Jinja's sandbox turns a lone unsafe attribute into an undefined value, which prints empty
    assert render_chat("[{{ ''.__class__ }}]", MSG) == "[]"


def test_template_helpers_behave_like_transformers():
    out = render_chat(
        "{{ messages[0]['content'] | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1) }}"
        "|{% for m in messages %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ dict(a=1) }}"
        "|{% generation %}kept{% endgeneration %}|{{ strftime_now('%Y') | length }}",
        [{"role": "user", "content": "<b>é</b>"}],
    )
    assert out == '"<b>é</b>"|{\n "b": 1,\n "a": [\n  1,\n  2\n ]\n}|1|{\'a\': 1}|kept|4'


def test_raise_exception_and_syntax_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", MSG)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", MSG)
    with pytest.raises(ChatTemplateError, match="KeyError|'name'"):
        render_chat("{{ messages[0]['name'] + 1 }}", MSG)


def test_templates_compile_once():
    from batchjob.models import chat

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat._compile(template) is chat._compile(template)
