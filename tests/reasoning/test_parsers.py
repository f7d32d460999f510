"""The reasoning parsers on recorded outputs, written token by token from the models' documented formats: Qwen3's
`<think>\\n...\\n</think>\\n\\n` answer, a Qwen3 thinking release's (the template opened `<think>`: the output starts
inside it), thinking turned off, thinking cut by max_tokens, DeepSeek-R1's (no `</think>`: all thinking), a stop
string, unicode; which prompts leave the completion inside `<think>`; the parser `auto` picks. The edges vLLM reads as
this does: a Qwen3 thinking that `<tool_call>` ends without `</think>`, DeepSeek-R1's blank space before `<think>`,
gpt-oss's messages to a function (calls, not answer) and several final messages (joined by newlines)."""
from __future__ import annotations

import pytest

from batchjob.errors import ConfigError
from batchjob.reasoning.parsers import ThinkParser, detect, reasoning_parser
from batchjob.reasoning.split import AddressedMessage
from batchjob.tool_calls.parsers import parse

VOCAB = ["<think>", "</think>", "\n", "\n\n", "Okay", ",", " the", " user", " asks", " 2+2", ".", "The", " answer",
         " is", " 4", "Hello", "!", " 日本", "語", " ✓", "<|im_start|>", "assistant", "<|im_end|>",
         "<tool_call>", "</tool_call>", "I need the weather.", '{"name": "get_weather", "arguments": {"city": "Lima"}}']
ID = {t: i for i, t in enumerate(VOCAB)}
QWEN3 = ThinkParser("qwen3", ID["<think>"], ID["</think>"])
R1 = ThinkParser("deepseek_r1", ID["<think>"], ID["</think>"])
QWEN3_TOOLS = ThinkParser("qwen3", ID["<think>"], ID["</think>"], tool_call_id=ID["<tool_call>"])
CALL = ("<tool_call>", "\n", '{"name": "get_weather", "arguments": {"city": "Lima"}}', "\n", "</tool_call>")


def ids(*tokens: str) -> list[int]:
    return [ID[t] for t in tokens]


def decode(token_ids) -> str:
    return "".join(VOCAB[i] for i in token_ids)


def test_qwen3_thinking_then_answer():
    out = ids("<think>", "\n", "Okay", ",", " the", " user", " asks", " 2+2", ".", "\n", "</think>", "\n\n", "The",
              " answer", " is", " 4", ".")
    split = QWEN3.split(out, decode, opened=False)
    assert split.reasoning == "Okay, the user asks 2+2." and split.content == "The answer is 4."
    assert split.reasoning_tokens == 9  # between the tags, the newlines in


def test_a_thinking_release_starts_inside_think_opened_by_its_template():
    prompt = ids("<|im_start|>", "assistant", "\n", "<think>", "\n")
    assert QWEN3.opened_by(prompt)
    out = ids("Okay", ",", " the", " user", " asks", " 2+2", ".", "\n", "</think>", "\n\n", "The", " answer", " is", " 4")
    split = QWEN3.split(out, decode, QWEN3.opened_by(prompt))
    assert split.reasoning == "Okay, the user asks 2+2." and split.content == "The answer is 4"
    assert split.reasoning_tokens == 8


def test_thinking_turned_off_by_the_template_is_an_answer_alone():
    prompt = ids("<|im_start|>", "assistant", "\n", "<think>", "\n\n", "</think>", "\n\n")  # enable_thinking false
    assert not QWEN3.opened_by(prompt)
    split = QWEN3.split(ids("Hello", "!"), decode, QWEN3.opened_by(prompt))
    assert split.reasoning is None and split.content == "Hello!" and split.reasoning_tokens == 0


def test_thinking_cut_by_max_tokens_is_all_reasoning():
    split = QWEN3.split(ids("<think>", "\n", "Okay", ",", " the"), decode, opened=False)
    assert split.reasoning == "Okay, the" and split.content == "" and split.reasoning_tokens == 4
    split = QWEN3.split(ids("Okay", ",", " the"), decode, opened=True)
    assert split.reasoning == "Okay, the" and split.reasoning_tokens == 3


def test_deepseek_r1_without_end_tag_is_all_thinking_and_qwen3_all_answer():
    out = ids("Okay", ",", " the", " user")
    assert R1.split(out, decode, opened=False).reasoning == "Okay, the user"
    assert QWEN3.split(out, decode, opened=False).reasoning is None


def test_unicode_and_earlier_turns():
    prompt = ids("<think>", "Okay", "</think>", "The", "<|im_end|>", "<|im_start|>", "assistant", "\n")  # a past turn
    assert not QWEN3.opened_by(prompt)
    out = ids("<think>", " 日本", "語", " ✓", "</think>", " 日本", "語")
    split = QWEN3.split(out, decode, QWEN3.opened_by(prompt))
    assert split.reasoning == " 日本語 ✓" and split.content == "日本語" and split.reasoning_tokens == 3


def test_a_stop_string_cuts_the_answer_as_it_cut_the_text():
    out = ids("<think>", "Okay", "</think>", "\n\n", "The", " answer", " is", " 4")
    split = QWEN3.split(out, decode, False, stop_text="<think>Okay</think>\n\nThe answer")
    assert split.reasoning == "Okay" and split.content == "The answer"


def test_a_qwen3_thinking_that_a_tool_call_ends_without_its_end_tag_ends_there():
    """Qwen3 releases may open `<tool_call>` right after thinking, without `</think>`: vLLM's qwen3 parser ends the
    thinking there, and so the call is the answer's, read by the hermes parser."""
    for opened, head in ((True, ()), (False, ("<think>",))):  # the template opened <think>, or the model did
        split = QWEN3_TOOLS.split(ids(*head, "I need the weather.", "\n\n", *CALL), decode, opened)
        assert split.reasoning == "I need the weather." and split.reasoning_tokens == 2
        assert split.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
        calls = parse("hermes", split.content)
        assert [c["function"]["name"] for c in calls.calls] == ["get_weather"] and calls.content == ""
    stopped = QWEN3_TOOLS.split(ids("I need the weather.", *CALL), decode, True,
                                stop_text='I need the weather.<tool_call>\n{"name"')
    assert stopped.reasoning == "I need the weather." and stopped.content == '<tool_call>\n{"name"'


def test_a_tool_call_inside_closed_thinking_stays_thinking_and_without_thinking_it_is_the_answer():
    closed = QWEN3_TOOLS.split(ids("<think>", "I need the weather.", *CALL, "</think>", "\n\n", "Hello"), decode, False)
    assert closed.reasoning.startswith("I need the weather.<tool_call>") and closed.content == "Hello"
    plain = QWEN3_TOOLS.split(ids("Hello", "!", *CALL), decode, opened=False)  # enable_thinking off: all answer
    assert plain.reasoning is None and plain.content.startswith("Hello!<tool_call>")
    assert R1.split(ids("I need the weather.", *CALL), decode, opened=True).content == ""  # R1: no such rule, as vLLM


def test_only_qwen3_ends_its_thinking_at_a_tool_call():
    known = {"<think>": 5, "</think>": 6, "<tool_call>": 7}.get
    assert reasoning_parser("qwen3", known, None)[0].tool_call_id == 7
    assert reasoning_parser("deepseek_r1", known, None)[0].tool_call_id is None


def test_deepseek_r1_blank_space_before_think_is_not_the_thinking():
    out = ids("\n", "<think>", "\n", "Okay", ",", " the", " user", " asks", " 2+2", ".", "\n", "</think>", "\n\n",
              "The", " answer", " is", " 4", ".")
    split = R1.split(out, decode, opened=False)
    assert split.reasoning == "Okay, the user asks 2+2." and split.content == "The answer is 4."
    assert split.reasoning_tokens == 9  # as without the newline before <think>
    cut = R1.split(ids("\n\n", "<think>", "Okay", ",", " the"), decode, opened=False)
    assert cut.reasoning == "Okay, the" and cut.content == "" and cut.reasoning_tokens == 3
    qwen = QWEN3.split(ids("\n", "<think>", "Okay", "</think>", "Hello"), decode, opened=False)
    assert qwen.reasoning == "Okay" and qwen.content == "Hello"
    text_first = QWEN3.split(ids("Hello", "<think>", "Okay"), decode, opened=False)  # not a leading <think>
    assert text_first.reasoning is None and text_first.content == "Hello<think>Okay"


def test_auto_picks_from_the_template_and_vocabulary():
    known = {"<think>": 5, "</think>": 6}.get
    assert detect(known, "{{ '<|im_start|>assistant\\n' }}") == "qwen3"
    assert detect(known, "{{'<｜Assistant｜><think>\\n'}}") == "deepseek_r1"
    assert detect({}.get, "<think>") is None
    assert reasoning_parser("auto", {}.get, None) == (None, "none")
    parser, name = reasoning_parser("deepseek_r1", known, None)
    assert name == "deepseek_r1" and (parser.start_id, parser.end_id) == (5, 6)
    with pytest.raises(ConfigError, match="has no <think> and </think> tokens"):
        reasoning_parser("qwen3", {}.get, None)


HARMONY_VOCAB = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "analysis", "final",
                 "commentary", "assistant", "User", " asks", " 2+2", ".", "The", " answer", " is", " 4", "\n",
                 "<|constrain|>", "json", " json", " ", " to=functions.get_weather", " to=browser.search", "Need",
                 " weather", '{"location":"San Francisco"}', '{"location":', "Let me check.", "It is sunny.",
                 "Sunny in SF.", '{"query":"weather"}']
SPECIAL = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"}
HID = {t: i for i, t in enumerate(HARMONY_VOCAB)}


def hids(*tokens: str) -> list[int]:
    return [HID[t] for t in tokens]


def hdecode(token_ids) -> str:
    return "".join(HARMONY_VOCAB[i] for i in token_ids)


def hdecode_skipping(token_ids) -> str:
    """As the job's tokenizer decodes: special tokens left out."""
    return "".join(HARMONY_VOCAB[i] for i in token_ids if HARMONY_VOCAB[i] not in SPECIAL)


def harmony():
    from batchjob.reasoning.harmony import TOKENS, HarmonyParser

    return HarmonyParser.of({t: HID[t] for t in (*TOKENS, "<|constrain|>")})


def test_gpt_oss_analysis_is_the_thinking_and_final_the_answer():
    out = hids("<|channel|>", "analysis", "<|message|>", "User", " asks", " 2+2", ".", "<|end|>", "<|start|>",
               "assistant", "<|channel|>", "final", "<|message|>", "The", " answer", " is", " 4", "<|return|>")
    split = harmony().split(out, hdecode, opened=False)
    assert split.reasoning == "User asks 2+2." and split.content == "The answer is 4" and split.reasoning_tokens == 4
    direct = harmony().split(hids("<|channel|>", "final", "<|message|>", "The", " answer"), hdecode, opened=False)
    assert direct.reasoning is None and direct.content == "The answer"
    cut = harmony().split(hids("<|channel|>", "analysis", "<|message|>", "User", " asks"), hdecode, opened=False)
    assert cut.reasoning == "User asks" and cut.content == "" and cut.reasoning_tokens == 2
    plain = harmony().split(hids("The", " answer"), hdecode, opened=False)
    assert plain.reasoning is None and plain.content == "The answer"


def test_gpt_oss_opened_by_a_prompt_inside_analysis():
    p = harmony()
    assert not p.opened_by(hids("<|start|>", "assistant"))
    inside = hids("<|start|>", "assistant", "<|channel|>", "analysis", "<|message|>")
    assert p.opened_by(inside)
    split = p.split(hids("User", " asks", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
                         "The", " answer"), hdecode, p.opened_by(inside))
    assert split.reasoning == "User asks" and split.content == "The answer" and split.reasoning_tokens == 2


@pytest.mark.parametrize("opened", [False, True])
def test_budget_grammars_stop_the_thinking_at_the_budget(smollm2_loaded, opened):
    """On SmolLM2's vocabulary (<think>, </think> played by two of its special tokens that are not EOS): within the
    budget a row may close its thinking; past it, only the closing tokens are allowed."""
    import llguidance

    from batchjob.engine.structured.grammar import GrammarTokenizer

    tok = smollm2_loaded.tokenizer
    start, end = tok.token_id("<repo_name>"), tok.token_id("<file_sep>")
    parser = ThinkParser("qwen3", start, end)
    gt = GrammarTokenizer.from_tokenizer(tok)
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.budget_lark(4, opened))
    think = tok.encode(" one two three four five six", add_special_tokens=False)
    head = [] if opened else [start]
    ok = head + think[:4] + [end] + tok.encode("\n\nyes", add_special_tokens=False)
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
    assert m.try_consume_tokens(ok) == len(ok)
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)  # (validate_tokens does not count max_tokens: the engine consumes)
    assert m.try_consume_tokens(head + think[:6]) == len(head) + 4  # the 5th thinking token must close it


# gpt-oss's function calls, as OpenAI's harmony guide writes them: the recipient after the channel (with
# `<|constrain|>json`), or before it in the header; a preamble (commentary without recipient) is the answer
GET_WEATHER = hids("<|channel|>", "analysis", "<|message|>", "Need", " weather", "<|end|>", "<|start|>", "assistant",
                   "<|channel|>", "commentary", " to=functions.get_weather", " ", "<|constrain|>", "json",
                   "<|message|>", '{"location":"San Francisco"}', "<|call|>")
RECIPIENT_FIRST = hids("<|channel|>", "commentary", "<|message|>", "Let me check.", "<|end|>", "<|start|>",
                       "assistant", " to=functions.get_weather", "<|channel|>", "commentary", " json", "<|message|>",
                       '{"location":"San Francisco"}', "<|call|>")


@pytest.mark.parametrize("decoder", [hdecode, hdecode_skipping], ids=["special-kept", "special-skipped"])
def test_gpt_oss_messages_to_a_function_are_calls_not_answer(decoder):
    split = harmony().split(GET_WEATHER, decoder, opened=False)
    assert split.reasoning == "Need weather" and split.content == "" and split.reasoning_tokens == 2
    assert split.calls == (AddressedMessage("functions.get_weather", "json", '{"location":"San Francisco"}'),)
    split = harmony().split(RECIPIENT_FIRST, decoder, opened=False)
    assert split.reasoning is None and split.content == "Let me check."
    assert split.calls == (AddressedMessage("functions.get_weather", "json", '{"location":"San Francisco"}'),)


def test_gpt_oss_a_parser_without_the_constrain_token_reads_the_same_calls():
    from batchjob.reasoning.harmony import TOKENS, HarmonyParser

    bare = HarmonyParser.of({t: HID[t] for t in TOKENS})
    for decoder in (hdecode, hdecode_skipping):
        assert bare.split(GET_WEATHER, decoder, opened=False) == harmony().split(GET_WEATHER, hdecode, opened=False)


def test_gpt_oss_several_final_messages_join_with_a_newline_as_vllm_joins_them():
    out = hids("<|channel|>", "analysis", "<|message|>", "Need", "<|end|>", "<|start|>", "assistant", "<|channel|>",
               "analysis", "<|message|>", " weather", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
               "<|message|>", "It is sunny.", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
               "<|message|>", "Sunny in SF.", "<|return|>")
    split = harmony().split(out, hdecode, opened=False)
    assert split.content == "It is sunny.\nSunny in SF." and split.reasoning == "Need\n weather"
    assert split.reasoning_tokens == 2 and split.calls == ()


def test_gpt_oss_a_built_in_tool_message_is_no_function_call_and_a_cut_header_is_nothing():
    out = hids("<|channel|>", "commentary", " to=browser.search", " json", "<|message|>", '{"query":"weather"}',
               "<|call|>")
    split = harmony().split(out, hdecode, opened=False)
    assert split.calls == (AddressedMessage("browser.search", "json", '{"query":"weather"}'),) and split.content == ""
    assert parse("openai", split.content, out, split.calls).calls is None  # not a function: no call, no error
    cut = harmony().split(hids("<|channel|>", "final", "<|message|>", "It is sunny.", "<|end|>", "<|start|>",
                               "assistant", "<|channel|>", "commentary"), hdecode, opened=False)
    assert cut.content == "It is sunny." and cut.calls == ()


def test_the_openai_tool_parser_reads_the_calls_of_the_split():
    split = harmony().split(GET_WEATHER, hdecode_skipping, opened=False)
    got = parse("openai", split.content, GET_WEATHER, split.calls)
    assert got.error is None and got.content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.calls] == [
        ("get_weather", '{"location": "San Francisco"}')]
    cut = GET_WEATHER[:-2] + hids('{"location":')  # max_tokens cut the arguments
    split = harmony().split(cut, hdecode, opened=False)
    bad = parse("openai", split.content, cut, split.calls)
    assert bad.calls is None and bad.error.startswith("openai: call 0 (get_weather): Expecting value")
    alone = parse("openai", "some text", GET_WEATHER)  # no harmony split: the job has no gpt_oss reasoning parser
    assert alone.calls is None and "--reasoning-parser gpt_oss" in alone.error
