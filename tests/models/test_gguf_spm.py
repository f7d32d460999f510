"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Phi-3, Gemma)
tokenize and decode as transformers does for the same file, and a tiny Llama GGUF with one generates the same
greedy text through batchjob.api as transformers loading that file.

The vocabularies are learned here (tests/builders.py's `sentencepiece_vocab`) and laid out as llama.cpp writes
them: special and control tokens, the 256 byte pieces, scored pieces, user-defined tokens.
"""
from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch

from batchjob import api
from batchjob.models.tokenizer import Tokenizer
from tests.builders import sentencepiece_vocab, with_gguf_vocab, write_gguf, write_vocab_gguf

transformers = pytest.importorskip("transformers")

CORPUS = """\
The quick brown fox jumps over the lazy dog. In 2024 I paid 12345 dollars for 3 apples.
Batch inference reads rows from files, runs a language model, and writes the answers back out.
def square(x: int) -> int:
    return x ** 2  # squares a number
Naïve café résumé — “quoted” text; 你好，世界。 Привет, мир! the them these those there then
"""
SIZE = 480

TEXTS = [
    "The quick brown fox",
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "two  spaces,   three   and    four",
    "line one\nline two\n\nafter a blank line\n",
    "\ttabbed\tcolumns\t\n\r\n",
    "Naïve café résumé, Ünïcödé — “quoted”",
    "你好，世界。中文字符不在词表里",
    "emoji 🙂👍🏽 and 👨‍👩‍👧",
    "In 2024 I paid 12345 dollars; 3.14159 and 0xFF",
    "def square(x: int) -> int:\n    return x ** 2",
    "<s>starts with BOS text",
    "text with </s> and <s> inside",
    "[INST] What is 2+2? [/INST] 4</s>",
    "<|user|>\nhi<|end|>\n<|assistant|>\n",
    "<think>reasoning</think> answer",
    "<unk> and <mask> and <pad> written out",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>gemma's bos text",
    "",
    " ",
    "    ",
    "\n",
    "a",
]

# (general.architecture, vocabulary flavour): Llama 2 / Mistral, Phi-3 (prefix space per chunk), Gemma 2/3
# (transformers reads no "gemma" GGUF, so Gemma 1, built as Gemma 2 is, has no reference)
CASES = [("llama", "llama"), ("phi3", "llama"), ("gemma2", "gemma"), ("gemma3", "gemma")]


def read_meta(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Factory: `pair(arch, flavour, **meta)` -> (ours, transformers') tokenizers of one vocabulary GGUF."""
    made = {}

    def make(arch: str, flavour: str, **changes):
        key = (arch, flavour, tuple(sorted((k, str(v)) for k, v in changes.items())))
        if key not in made:
            meta = sentencepiece_vocab(CORPUS, SIZE, flavour)
            for k, v in changes.items():
                if v is None:
                    meta.pop(f"tokenizer.ggml.{k}", None)
                else:
                    meta[f"tokenizer.ggml.{k}"] = v
            path = write_vocab_gguf(tmp_path_factory.mktemp(f"spm_{arch}") / "vocab.gguf", arch, meta)
            made[key] = Tokenizer.from_gguf_metadata(read_meta(path), source=str(path)), hf_tokenizer(path)
        return made[key]

    return make


def assert_same(ours: Tokenizer, hf, text: str) -> None:
    plain = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == plain, text
    with_bos = hf.encode(text)
    if text.startswith(ours.bos_token):  # we add no second BOS in front of one the text writes (Tokenizer.encode)
        assert with_bos[:2] == [ours.bos_token_id] * 2
        with_bos = with_bos[1:]
    assert ours.encode(text) == with_bos, text
    assert ours.encode_batch([text, text]) == [with_bos, with_bos]
    # a decode from any position: a generated text starts mid-sequence, where the leading '▁' matters
    for start in range(len(with_bos)):
        ids = with_bos[start:]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), (text, start)
    assert ours.decode(with_bos, skip_special_tokens=False) == hf.decode(with_bos, skip_special_tokens=False)


@pytest.mark.parametrize("arch,flavour", CASES)
def test_encode_and_decode_match_transformers(pair, arch, flavour):
    ours, hf = pair(arch, flavour)
    for text in TEXTS:
        assert_same(ours, hf, text)
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert ours.vocab_size == hf.backend_tokenizer.get_vocab_size(with_added_tokens=True) == SIZE


@pytest.mark.parametrize("arch,flavour", CASES)
def test_special_tokens_and_bos(pair, arch, flavour):
    ours, hf = pair(arch, flavour)
    meta = sentencepiece_vocab(CORPUS, SIZE, flavour)
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos, eot = (meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "eot"))
    assert (ours.bos_token, ours.bos_token_id, ours.add_bos_token) == (hf.bos_token, bos, True)
    assert ours.eos_token == hf.eos_token == tokens[eos] and ours.eos_token_ids == [eos, eot]  # eot stops too
    # the byte pieces decode to their bytes; special tokens are skipped, user-defined ones are text
    assert ours.decode([tokens.index("<0xE2>"), tokens.index("<0x82>"), tokens.index("<0xAC>")]) == "€"
    assert ours.decode([bos, eos, eot]) == ""
    user_defined = [t for t, k in zip(tokens, meta["tokenizer.ggml.token_type"]) if k == 4 and t.strip(" ")]
    assert user_defined and [ours.decode([tokens.index(t)]) for t in user_defined] == user_defined


@pytest.mark.parametrize("arch,flavour", [("llama", "llama"), ("gemma2", "gemma")])
def test_files_without_add_bos_add_it_and_files_saying_no_do_not(pair, arch, flavour):
    for add_bos in (None, False):
        ours, hf = pair(arch, flavour, add_bos_token=add_bos)
        assert ours.add_bos_token == (add_bos is None)
        for text in ("Hello world", " x", ""):
            assert ours.encode(text) == hf.encode(text), (add_bos, text)


def test_merges_in_the_file_are_used(pair):
    # llama.cpp writes none for a SentencePiece vocabulary, but a file may; then its merges decide, not the scores
    ours, hf = pair("llama", "llama")
    merges = [" ".join(m) for m in json.loads(hf.backend_tokenizer.to_str())["model"]["merges"]]
    ours2, hf2 = pair("llama", "llama", merges=merges[len(merges) // 2:])  # the better half left out
    assert ours2.encode("The quick brown fox") != ours.encode("The quick brown fox")
    for text in TEXTS:
        assert_same(ours2, hf2, text)


def test_class_special_tokens_stay_special_without_ids_in_the_file(pair):
    # LlamaTokenizer's <unk>/<s>/</s> and GemmaTokenizer's five are special whatever the file's ids say
    for arch, flavour in (("llama", "llama"), ("gemma2", "gemma")):
        ours, hf = pair(arch, flavour, unknown_token_id=None, padding_token_id=None)
        assert ours.decode(ours.encode("a<unk>b", add_special_tokens=False)) == "ab"  # <unk> is not a control token
        for text in TEXTS:
            assert_same(ours, hf, text)


def test_merges_from_scores_orders_as_transformers():
    from transformers.tokenization_utils_base import generate_merges

    from batchjob.models.tokenizer import _merges_from_scores

    tokens = sentencepiece_vocab(CORPUS, SIZE)["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    for scores in ({t: -float(i) for i, t in enumerate(tokens)}, {t: 0.0 for t in tokens},  # ties: by cut lengths
                   {t: float(len(t) % 3) for t in reversed(tokens)}):
        assert _merges_from_scores(vocab, scores) == generate_merges(vocab, scores)


def test_unsupported_and_incomplete_vocabularies_are_clear_errors():
    with pytest.raises(ValueError, match=r"'t5' is not supported; supported: 'gpt2' .*'llama' \(SentencePiece"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]},
                                     source="x.gguf")


# ---- a tiny Llama GGUF with a SentencePiece vocabulary: greedy text as transformers' ------------------------


@pytest.fixture(scope="module")
def spm_llama_gguf(tmp_path_factory, tiny_tokenizer_dir):
    """A 2-layer random Llama (hidden 64) written as llama.cpp writes a Llama 2 GGUF, with a 480-piece vocabulary."""
    cfg = transformers.LlamaConfig(vocab_size=SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights that give varied greedy text (HF's init is near-flat)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((1.0 if "embed_tokens" in name else 0.15) * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("spm_llama")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what write_gguf reads; the vocabulary is then replaced
        shutil.copy(tiny_tokenizer_dir / name, folder / name)
    byte_level = write_gguf(folder, folder / "byte_level.gguf", "Q8_0")
    out = tmp_path_factory.mktemp("spm_llama_gguf") / "spm-llama.Q8_0.gguf"
    return with_gguf_vocab(byte_level, out, sentencepiece_vocab(CORPUS, SIZE, "llama"))


PROMPTS = ["The quick brown fox", "Batch inference reads", " def square(x):", "你好 🙂", "two  spaces\nand a line",
           "[INST] hi [/INST]"]


def test_greedy_text_matches_transformers(spm_llama_gguf):
    path = spm_llama_gguf
    # --quantization none: the file's values dequantized, as transformers reads them (auto computes its blocks as
    # stored: tests/models/test_gguf_blocks.py holds that against this)
    llm = api.LLM(str(path), dtype="float32", kernels="torch", kv_cache_gb=0.05, quantization="none")
    got = llm.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    hf_tok = hf_tokenizer(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    texts = set()
    for prompt, result in zip(PROMPTS, got):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert llm.tokenizer.encode(prompt) == ids[0].tolist()
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
        assert (result.prompt_tokens, result.completion_tokens) == (ids.shape[1], 16)
        assert result.text == hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt
        texts.add(result.text)
    assert len(texts) == len(PROMPTS) and all(len(set(t)) > 3 for t in texts)  # varied text
