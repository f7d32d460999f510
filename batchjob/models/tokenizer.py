"""Tokenizer: text <-> token ids and chat prompts, from an HF folder or a GGUF file's vocabulary.

Wraps a `tokenizers.Tokenizer`. BOS is added by us, from the model's `add_bos_token`, never by the
backend's post-processor, so one flag decides it for both sources.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from batchjob.models.chat import ChatTemplateError, render_chat

# llama.cpp's `tokenizer.ggml.pre` -> the split regex its merges were learned with (same as transformers).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types
# SentencePiece vocabularies (`tokenizer.ggml.model` = "llama") come in three shapes, chosen by architecture as
# transformers chooses them; each has the special tokens of the transformers class it builds from.
_SPM_FLAVOURS = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
_SPM_CLASS_SPECIALS = {
    "llama": ("<unk>", "<s>", "</s>"),  # LlamaTokenizer's
    "phi3": ("<unk>", "<s>", "</s>"),
    "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>"),  # GemmaTokenizer's
}
_GGUF_TOKENIZERS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE: Llama 2, Mistral, Gemma, Phi-3)"


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token = eos_tokens[0] if eos_tokens else None
        ids = [backend.token_to_id(t) for t in eos_tokens] + list(eos_token_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in ids if i is not None))
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens written in the text (e.g. "<|im_start|>") are always matched whole.
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call into the tokenizers library (its Rust loop, not Python's)."""
        out = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)] if texts else []
        if add_special_tokens and self.add_bos_token:
            for ids in out:
                if not ids or ids[0] != self.bos_token_id:
                    ids.insert(0, self.bos_token_id)
        return out

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary written as its text (`<think>`), or None."""
        return self.backend.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **variables,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError(
                "this model has no chat template; pass one (chat_template=...) or send plain prompts"
            )
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables = {**{k: v for k, v in special.items() if v is not None}, **variables}
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **variables)

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, folder: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json, config.json)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(path))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        bos = _token_text(tcfg.get("bos_token"))
        if bos is None and (bos_id := gen.get("bos_token_id", model_cfg.get("bos_token_id"))) is not None:
            bos = backend.id_to_token(bos_id) if isinstance(bos_id, int) else None
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"])
        else:  # no flag: the model adds BOS iff its post-processor does
            bos_id = backend.token_to_id(bos) if bos is not None else None
            add_bos = bos_id is not None and bos_id in backend.encode("a", add_special_tokens=True).ids

        eos = _token_text(tcfg.get("eos_token"))
        eos_ids = _as_list(gen.get("eos_token_id")) + _as_list(model_cfg.get("eos_token_id"))

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():  # transformers >= 4.43 saves it here instead of in tokenizer_config
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(tcfg.get("chat_template"))
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=[eos] if eos is not None else [],
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=template,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict, source: str = "GGUF") -> "Tokenizer":
        """The vocabulary of GGUF metadata given as Python values, built as transformers builds it from the file:
        byte-level BPE (`tokenizer.ggml.model` = "gpt2") or SentencePiece BPE ("llama")."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend, spelled = _byte_level_backend(meta)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        elif kind == "llama":
            backend, spelled = _sentencepiece_backend(meta, source)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (so does transformers)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported; supported: {_GGUF_TOKENIZERS}")

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return spelled[i] if i is not None and 0 <= i < len(spelled) else None

        # llama.cpp stops on eot/eom as well as eos (e.g. Llama 3's <|eot_id|>, Gemma's <end_of_turn>)
        eos = [t for t in (token("eos_token_id"), token("eot_token_id"), token("eom_token_id")) if t is not None]
        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_tokens=eos,
            add_bos_token=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )


def _byte_level_backend(meta: dict) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Byte-level BPE (`tokenizer.ggml.model` = "gpt2") and the tokens as its vocabulary spells them."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    # As transformers does: a token outside the byte alphabet is written as raw text; respell it.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False)
    )
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) match whole in text; one spelled outside the byte alphabet is a
    # llama.cpp mislabel and adding it would grow the vocabulary, so it is skipped (as transformers does).
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types)
            if kind == _GGUF_CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED]
    )
    return backend, spelled


def _sentencepiece_backend(meta: dict, source: str) -> tuple[tokenizers.Tokenizer, list[str]]:
    """SentencePiece BPE (`tokenizer.ggml.model` = "llama") as transformers 5 builds it (its
    integrations/gguf/gguf_tokenizer_mapping.py), and the tokens as its vocabulary spells them.

    BPE with byte fallback (<0x..> pieces) over the file's pieces, with the file's merges or, as llama.cpp writes
    none, the merges the pieces and their scores imply. How a space becomes '▁' depends on the architecture:
    Llama/Mistral prefix the text with one ('▁' in front of the first chunk only); Phi-3 prefix every chunk between
    special tokens; Gemma none, and its order of merges is the file's order, not its scores'. Like transformers,
    `tokenizer.ggml.add_space_prefix` is not read.
    """
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    flavour = _SPM_FLAVOURS.get(meta.get("general.architecture"), "llama")
    spelled = tokens
    if flavour == "gemma":  # a piece of 2+ spaces is stored as spaces ("  "), looked up as "▁▁"
        spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    elif flavour == "gemma":
        merges = _merges_from_scores(vocab, {t: -i for i, t in enumerate(spelled)})
    elif meta.get("tokenizer.ggml.scores") is not None:
        merges = _merges_from_scores(vocab, dict(zip(spelled, meta["tokenizer.ggml.scores"])))
    else:
        raise ValueError(
            f"{source}: a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores or .merges; it has neither"
        )

    unk = "<unk>" if flavour == "gemma" else None  # what GemmaTokenizer / LlamaTokenizer give their BPE
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk)
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if flavour == "gemma":
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif flavour == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if flavour != "gemma":  # the prefixed '▁' comes off the decoded text again
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)

    # Matched whole in text, in transformers' order (a token keeps the first role it gets): special, so skipped
    # when decoding, the class's own special tokens and the control tokens; as text, the user-defined ones; then
    # special, the file's bos/eos/unk/pad. transformers appends one the vocabulary lacks as a new id, past the
    # model's embeddings; we leave it out.
    control = [t for t, kind in zip(spelled, types) if kind == _GGUF_CONTROL]
    special = [t for t in dict.fromkeys([*_SPM_CLASS_SPECIALS[flavour], *control]) if t in vocab]
    user_defined = [
        t for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED and t in vocab and t not in special
    ]
    named = [spelled[i] for key in ("bos", "eos", "unknown", "padding")
             if isinstance(i := meta.get(f"tokenizer.ggml.{key}_token_id"), int) and 0 <= i < len(spelled)]
    special += [t for t in dict.fromkeys(named) if t not in special and t not in user_defined]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    return backend, spelled


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, as transformers' `generate_merges` orders them: each way
    to cut a piece into two pieces, the best-scored piece first (ties: the longer left part, then right part)."""
    merges = []
    for piece, score in scores.items():
        cuts = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(cuts, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: each digit alone, then the GPT-2 regex (as SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GGUF_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level  # "gpt2", "default" and the rest: plain GPT-2 regex, as transformers does


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    # tokenizer_config writes special tokens as a string or as an AddedToken dict
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _pick_template(value) -> str | None:
    # older tokenizer_configs may hold a list of named templates
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value
