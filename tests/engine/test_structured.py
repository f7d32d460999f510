"""Structured outputs' grammar layer (engine/structured/): spec parsing and its errors, compiling off-thread with
the compiler's messages, matchers driven token by token with the tests' tiny BPE tokenizer (choice, regex, JSON
schema), EOS only where the grammar may end, speculative prefixes, rebuilding from tokens, and the bitmask
applied to logits exactly as masked_fill_ of the unpacked bits."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from batchjob.engine.structured.grammar import GrammarCache, GrammarState, GrammarTokenizer, compile_grammar
from batchjob.engine.structured.mask import apply_token_bitmask_, unpack_bitmask
from batchjob.engine.structured.matcher import ALL_ALLOWED, MaskFiller, Matcher
from batchjob.engine.structured.spec import StructuredOutputs, StructuredOutputsError, from_response_format, parse_structured_outputs
from batchjob.engine.structured import grammar as grammar_module
from batchjob.engine.structured import mask as mask_module
from batchjob.models.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def gtok(tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer.from_tokenizer(tokenizer)


def compiled(gtok: GrammarTokenizer, **structured):
    status = compile_grammar(parse_structured_outputs(structured), gtok)
    assert status.state is GrammarState.READY, status.error
    return status.grammar


def mask_of(matcher: Matcher) -> torch.Tensor:
    row = torch.zeros(matcher.grammar.tokenizer.bitmask_words, dtype=torch.int32)
    matcher.fill(row)
    return row


def allowed(matcher: Matcher, token: int) -> bool:
    return bool((int(mask_of(matcher)[token // 32]) >> (token % 32)) & 1)


def drive(matcher: Matcher, tokens: list[int], eos: int, ends_only_at_the_end: bool = True) -> None:
    """Feed `tokens` one at a time, checking that each was allowed and that EOS was allowed exactly where the
    grammar could end (only after the last token, unless told otherwise)."""
    for i, t in enumerate(tokens):
        assert allowed(matcher, t), f"token {i} ({t}) not allowed"
        assert allowed(matcher, eos) == matcher.can_end(), f"EOS mask and can_end disagree at {i}"
        assert not (ends_only_at_the_end and matcher.can_end()), f"may end before the end, at {i}"
        assert matcher.consume(t)
    assert matcher.can_end() and allowed(matcher, eos)


# ---- spec ---------------------------------------------------------------------------------------------------


def test_each_kind_parses_to_its_canonical_text():
    a = parse_structured_outputs({"json": {"type": "object", "properties": {"b": {}, "a": {}}}})
    b = parse_structured_outputs({"json": '{ "type": "object",\n  "properties": {"b": {}, "a": {}} }'})
    assert a == b and a.key == b.key and a.kind == "json"
    # key order is kept: it is the order the output writes the properties in
    assert parse_structured_outputs({"json": {"type": "object", "properties": {"a": {}, "b": {}}}}).key != a.key
    assert parse_structured_outputs({"json_object": True}) == StructuredOutputs("json_object", "")
    assert parse_structured_outputs({"regex": "[0-9]+"}).text == "[0-9]+"
    choice = parse_structured_outputs({"choice": ["yes", "no", "yes"]})
    assert choice.choices == ["yes", "no"]
    assert parse_structured_outputs('{"grammar": "start: \\"a\\""}').grammar_syntax == "lark"
    assert parse_structured_outputs({"grammar": 'root ::= "a" | "b"'}).grammar_syntax == "gbnf"
    assert parse_structured_outputs(None) is None
    assert parse_structured_outputs({"regex": None, "json": None}) is None  # nulls count as absent
    assert parse_structured_outputs({"regex": "a", "choice": None}).kind == "regex"
    assert len({s.key for s in (a, choice, parse_structured_outputs({"regex": "[0-9]+"}))}) == 3


@pytest.mark.parametrize("value, message", [
    ({"schema": {}}, "unknown key 'schema'; allowed: json, json_object, regex, choice, grammar"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of json, json_object, regex, choice, grammar, got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json: the schema is not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json: a JSON schema must be an object"),
    ({"json_object": False}, "structured_outputs.json_object: must be true"),
    ({"choice": "yes"}, "structured_outputs.choice: expected a non-empty list of strings"),
    ({"choice": []}, "structured_outputs.choice: expected a non-empty list of strings"),
    ({"regex": ""}, "structured_outputs.regex: expected a regular expression"),
    ({"grammar": 3}, "structured_outputs.grammar: expected a Lark or GBNF grammar"),
    ("{oops", "structured_outputs: not valid JSON"),
    (["json"], "structured_outputs: expected an object"),
])
def test_bad_shapes_fail_naming_the_field(value, message):
    with pytest.raises(StructuredOutputsError) as e:
        parse_structured_outputs(value)
    assert message in str(e.value)


def test_response_format_maps_to_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert spec == parse_structured_outputs({"json": schema})
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    assert from_response_format({"type": "text"}) is None
    assert from_response_format(None) is None
    for bad, message in [({"type": "xml"}, "response_format.type: 'xml' is not one of"),
                         ({"type": "json_schema"}, "response_format.json_schema: expected an object"),
                         ({"type": "json_schema", "json_schema": {"name": "x"}}, "missing 'schema'"),
                         ("json", "response_format: expected an object")]:
        with pytest.raises(StructuredOutputsError) as e:
            from_response_format(bad)
        assert message in str(e.value)


def test_a_spec_is_frozen():
    spec = parse_structured_outputs({"regex": "a"})
    with pytest.raises(AttributeError):
        spec.text = "b"


# ---- compiling ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("structured, message", [
    ({"json": {"type": "foo"}}, "Invalid type: foo"),
    ({"json": {"type": "array", "uniqueItems": True}}, "Unimplemented keys"),
    ({"regex": "[0-9"}, "unclosed character class"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"grammar": 'root ::= ("a"'}, "GBNF grammar does not convert to Lark: Expected ')'"),
    ({"grammar": 'root ::= foo'}, "Rule 'foo' not found"),
])
def test_what_does_not_compile_fails_with_the_compilers_message(gtok, structured, message):
    cache = GrammarCache(gtok)
    status = cache.wait(parse_structured_outputs(structured), timeout=600)
    assert status.state is GrammarState.FAILED and status.grammar is None
    assert message in status.error
    cache.close()


def test_the_cache_compiles_each_spec_once_off_the_callers_thread(gtok, monkeypatch):
    gate, calls = threading.Event(), []

    def slow_compile(spec, tokenizer, limits):
        calls.append(spec.key)
        gate.wait(10)
        return compile_grammar(spec, tokenizer, limits)

    monkeypatch.setattr(grammar_module, "compile_grammar", slow_compile)
    cache = GrammarCache(gtok, max_entries=2)
    spec = parse_structured_outputs({"regex": "[0-9]+"})
    assert cache.status(spec).state is GrammarState.PENDING  # the caller is not held up
    assert cache.status(parse_structured_outputs({"regex": "[0-9]+"})).state is GrammarState.PENDING
    gate.set()
    assert cache.wait(spec, timeout=600).state is GrammarState.READY
    assert cache.status(spec).grammar is cache.status(spec).grammar
    assert calls == [spec.key]
    bad = parse_structured_outputs({"regex": "("})
    assert cache.wait(bad, timeout=600).state is GrammarState.FAILED
    assert cache.status(bad).state is GrammarState.FAILED and calls == [spec.key, bad.key]  # failures are kept
    cache.wait(parse_structured_outputs({"choice": ["a"]}), timeout=600)
    assert len(cache) == 2  # the least recently asked is dropped
    cache.close()


def test_a_crashing_compile_fails_the_spec_not_the_caller(gtok, monkeypatch):
    def crash(spec, tokenizer, limits):
        raise RuntimeError("boom")

    monkeypatch.setattr(grammar_module, "compile_grammar", crash)
    cache = GrammarCache(gtok)
    status = cache.wait(parse_structured_outputs({"regex": "a"}), timeout=600)
    assert status.state is GrammarState.FAILED and status.error == "grammar compile crashed: RuntimeError: boom"
    cache.close()


def test_unknown_grammar_text_is_lark_and_gbnf_converts(gtok, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    for text in ('start: "ab" NUM\nNUM: /[0-9]+/', 'root ::= "ab" num\nnum ::= [0-9]+'):
        m = Matcher(compiled(gtok, grammar=text))
        drive(m, tokenizer.encode("ab12"), eos, ends_only_at_the_end=False)
        assert not m.is_finished()  # more digits may follow


# ---- matchers -----------------------------------------------------------------------------------------------


def test_choice_allows_only_the_choices_and_ends_with_them(gtok, tokenizer):
    grammar = compiled(gtok, choice=["quick brown", "lazy dog", 'say "hi"\n'])
    eos = tokenizer.eos_token_ids[0]
    for choice in ("quick brown", "lazy dog", 'say "hi"\n'):
        m = Matcher(grammar)
        drive(m, tokenizer.encode(choice), eos)
        assert m.is_finished()
        bits = unpack_bitmask(mask_of(m).unsqueeze(0), gtok.mask_vocab)[0]
        assert bits.nonzero().flatten().tolist() == [eos]  # a complete grammar allows EOS alone
        assert m.consume(eos) and m.num_tokens == len(tokenizer.encode(choice)) + 1
    m = Matcher(grammar)
    fox = tokenizer.encode(" fox")[0]
    before = mask_of(m)
    assert not allowed(m, fox) and not m.consume(fox)  # refused, and the matcher did not move
    assert m.num_tokens == 0 and torch.equal(mask_of(m), before) and m.error is None


def test_regex_allows_eos_once_it_may_end(gtok, tokenizer):
    m = Matcher(compiled(gtok, regex="[0-9]{2,4}"))
    eos = tokenizer.eos_token_ids[0]
    digits = [tokenizer.encode(d)[0] for d in "1234"]
    assert len(tokenizer.encode("1")) == 1
    for i, t in enumerate(digits):
        assert allowed(m, eos) == (i >= 2) == m.can_end()
        assert m.consume(t)
    assert m.is_finished() and not m.consume(digits[0])
    assert m.validate_prefix([eos, eos]) == 1
    m = Matcher(m.grammar)
    assert not m.consume(digits + [eos, eos]) and m.num_tokens == 0
    assert m.validate_prefix(digits + [eos]) == 5 and m.consume(digits + [eos]) and m.num_tokens == 5


def test_json_schema_tokens_drive_the_matcher_to_the_end(gtok, tokenizer):
    grammar = compiled(gtok, json=SCHEMA)
    eos = tokenizer.eos_token_ids[0]
    for value in ({"name": "Alice", "age": 12, "ok": True}, {"name": "café — \"q\"", "age": 0, "ok": False}):
        text = json.dumps(value, ensure_ascii=False)
        m = Matcher(grammar)
        drive(m, tokenizer.encode(text), eos)
        jsonschema.validate(json.loads(tokenizer.decode(tokenizer.encode(text))), SCHEMA)
    wrong = tokenizer.encode('{"name": "A", "age": "x"')  # a string where the schema wants an integer
    assert Matcher(grammar).validate_prefix(wrong) < len(wrong)


@pytest.mark.parametrize("structured", [{"json": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}},
                                        {"json_object": True}, {"regex": "[a-f]{3}-[0-9]{2}"}])
def test_masked_argmax_of_random_logits_matches_the_grammar(gtok, tokenizer, structured):
    """The layer end to end, as the engine will use it: fill -> apply to logits -> argmax -> consume."""
    grammar = compiled(gtok, **structured)
    eos = tokenizer.eos_token_ids[0]
    gen = torch.Generator().manual_seed(0)
    filler = MaskFiller()
    bitmask = gtok.allocate_bitmask(1)
    m, out = Matcher(grammar), []
    for _ in range(2000):  # any object ends after ~750 random tokens
        filler.fill(bitmask, [m])
        logits = torch.randn(1, gtok.logits_width, generator=gen)
        if structured.get("json_object"):
            logits[0, eos] += 3.0  # any object may run on and on: end it as soon as it may end
        apply_token_bitmask_(logits, bitmask)
        token = int(logits.argmax())
        if token == eos:
            break
        assert m.consume(token)
        out.append(token)
        if m.is_finished():
            break
    assert m.can_end()
    text = tokenizer.decode(out)
    if "json" in structured:
        jsonschema.validate(json.loads(text), structured["json"])
    elif "json_object" in structured:
        assert isinstance(json.loads(text), dict)
    else:
        assert len(text) == 6 and text[3] == "-"


def test_validate_prefix_rollback_and_rebuild(gtok, tokenizer):
    grammar = compiled(gtok, json=SCHEMA)
    tokens = tokenizer.encode('{"name": "Bob", "age": 7, "ok": true}')
    m = Matcher(grammar)
    assert m.validate_prefix(tokens) == len(tokens) and m.num_tokens == 0  # validating does not advance
    bad = tokens[:5] + tokenizer.encode("}") + tokens[5:]
    assert m.validate_prefix(bad) == 5
    assert m.consume(tokens[:6])
    m.rollback(3)
    assert torch.equal(mask_of(m), mask_of(Matcher(grammar, tokens[:3])))
    with pytest.raises(ValueError, match="has consumed 3"):
        m.rollback(4)
    assert m.error is None
    m.reset()
    assert m.num_tokens == 0 and torch.equal(mask_of(m), mask_of(Matcher(grammar)))
    # after a preemption: the same mask from the row's tokens alone, at every position
    live = Matcher(grammar)
    for i, t in enumerate(tokens):
        assert torch.equal(mask_of(live), mask_of(Matcher(grammar, tokens[:i])))
        live.consume(t)
    with pytest.raises(ValueError, match="do not match its grammar"):
        Matcher(grammar, bad)


def test_fill_draft_masks_each_proposed_position(gtok, tokenizer):
    grammar = compiled(gtok, regex="[0-9]{2,4}")
    eos = tokenizer.eos_token_ids[0]
    d = [tokenizer.encode(c)[0] for c in "123"]
    letter = tokenizer.encode("a")[0]
    m = Matcher(grammar, d[:1])
    rows = torch.zeros(5, gtok.bitmask_words, dtype=torch.int32)
    assert m.fill_draft(rows, [d[1], d[2], letter, d[0]]) == 2 and m.num_tokens == 1
    for j in range(3):
        assert torch.equal(rows[j], mask_of(Matcher(grammar, d[:1] + d[1:1 + j])))
    assert (rows[3:] == ALL_ALLOWED).all()
    rows = torch.zeros(3, gtok.bitmask_words, dtype=torch.int32)
    m = Matcher(grammar, d[:3])
    assert m.fill_draft(rows, [d[0], eos]) == 2  # EOS counts where the grammar may end
    assert torch.equal(rows[2], mask_of(Matcher(grammar, d[:3] + [d[0]])))


def test_batch_fill_equals_each_row_alone_and_leaves_free_rows_open(gtok, tokenizer):
    grammars = [compiled(gtok, json=SCHEMA), compiled(gtok, regex="[0-9]+"), compiled(gtok, choice=["lazy dog"])]
    prefixes = ['{"name": "x', "12", "lazy"]
    matchers = [Matcher(g, tokenizer.encode(p)) for g, p in zip(grammars, prefixes)]
    rows = [matchers[0], None, matchers[1], matchers[2], None]
    for threads in (1, 2):
        bitmask = torch.zeros(6, gtok.bitmask_words, dtype=torch.int32)
        MaskFiller(threads).fill(bitmask, rows)
        for i, m in enumerate(rows):
            expected = mask_of(m) if m is not None else torch.full((gtok.bitmask_words,), ALL_ALLOWED)
            assert torch.equal(bitmask[i], expected), (threads, i)
        assert (bitmask[5] == 0).all()  # rows past the matchers are not touched


def test_logits_columns_past_the_tokenizer_are_masked(tokenizer):
    wide = GrammarTokenizer.from_tokenizer(tokenizer, logits_width=tokenizer.vocab_size + 45)
    assert wide.bitmask_words == (tokenizer.vocab_size + 45 + 31) // 32
    m = Matcher(compiled(wide, json_object=True))
    bitmask = wide.allocate_bitmask(1)
    MaskFiller().fill(bitmask, [m])
    assert not unpack_bitmask(bitmask, wide.logits_width)[0, tokenizer.vocab_size:].any()
    logits = torch.zeros(1, wide.logits_width)
    apply_token_bitmask_(logits, bitmask)
    assert torch.isneginf(logits[0, tokenizer.vocab_size:]).all()
    assert torch.isfinite(logits[0, :tokenizer.vocab_size]).any()


def test_a_tokenizer_without_eos_is_refused(tokenizer):
    with pytest.raises(ValueError, match="EOS"):
        GrammarTokenizer(tokenizer.backend, [])


# ---- applying the mask --------------------------------------------------------------------------------------


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))


def bitwise(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [64, 1000, 4099])
def test_apply_equals_masked_fill_of_the_unpacked_bits(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + 1  # a wider bitmask than the logits: its extra bits are ignored
    bitmask = torch.randint(-2**31, 2**31 - 1, (7, words), dtype=torch.int32, generator=gen)
    bitmask[1] = 0
    bitmask[2] = ALL_ALLOWED
    logits = (torch.randn(7, vocab, generator=gen) * 30).to(dtype)
    logits[0, :6] = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), 1e4, -1e4]).to(dtype)
    expected = reference(logits, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(bitwise(logits), bitwise(expected))  # bit for bit: -0.0 stays -0.0
    assert torch.isneginf(logits[1]).all() and torch.equal(bitwise(logits[2]), bitwise(expected[2]))


def test_apply_to_chosen_rows_of_non_contiguous_logits_in_chunks(monkeypatch):
    monkeypatch.setattr(mask_module, "_CHUNK_ELEMENTS", 64)  # two rows a pass
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(9, 130, generator=gen)
    logits = base[:, 2:102]  # 100 columns of a wider buffer
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    idx = torch.tensor([7, 0, 3, 8, 5])
    expected = logits.clone()
    expected[idx] = reference(logits[idx], bitmask)
    apply_token_bitmask_(logits, bitmask, idx)
    assert torch.equal(logits, expected)
    assert torch.equal(base[:, :2], torch.randn(9, 130, generator=torch.Generator().manual_seed(1))[:, :2])
    wide = base.clone()
    view = wide[:, 10:110]  # every row, non-contiguous: written through the view
    bm = torch.randint(-2**31, 2**31 - 1, (9, 4), dtype=torch.int32, generator=gen)
    want = reference(view, bm)
    apply_token_bitmask_(view, bm)
    assert torch.equal(wide[:, 10:110], want) and torch.equal(wide[:, 110:], base[:, 110:])


def test_apply_refuses_a_bitmask_narrower_than_the_logits():
    with pytest.raises(ValueError, match="cover 32 tokens, the logits have 33"):
        apply_token_bitmask_(torch.zeros(1, 33), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 bitmask rows for 1 logits rows"):
        apply_token_bitmask_(torch.zeros(1, 32), torch.zeros(2, 1, dtype=torch.int32))
