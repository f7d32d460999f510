"""The reasoning parsers on recorded outputs, written token by token from the models' documented formats: Qwen3's
`<think>\\n...\\n</think>\\n\\n` answer, a Qwen3 thinking release's (the template opened `<think>`: the output starts
inside it), thinking turned off, thinking cut by max_tokens, DeepSeek-R1's (no `</think>`: all thinking), a stop
string, unicode; which prompts leave the completion inside `<think>`; the parser `auto` picks."""
from __future__ import annotations

import pytest

from batchjob.errors import ConfigError
from batchjob.reasoning.parsers import ThinkParser, detect, reasoning_parser

VOCAB = ["<think>", "</think>", "\n", "\n\n", "Okay", ",", " the", " user", " asks", " 2+2", ".", "The", " answer",
         " is", " 4", "Hello", "!", " 日本", "語", " ✓", "<|im_start|>", "assistant", "<|im_end|>"]
ID = {t: i for i, t in enumerate(VOCAB)}
QWEN3 = ThinkParser("qwen3", ID["<think>"], ID["</think>"])
R1 = ThinkParser("deepseek_r1", ID["<think>"], ID["</think>"])


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
                 "commentary", "assistant", "User", " asks", " 2+2", ".", "The", " answer", " is", " 4", "\n"]
HID = {t: i for i, t in enumerate(HARMONY_VOCAB)}


def hids(*tokens: str) -> list[int]:
    return [HID[t] for t in tokens]


def hdecode(token_ids) -> str:
    return "".join(HARMONY_VOCAB[i] for i in token_ids)


def harmony():
    from batchjob.reasoning.harmony import TOKENS, HarmonyParser

    return HarmonyParser.of({t: HID[t] for t in TOKENS})


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
    ok = head + think[:3] + [end] + tok.encode("\n\nyes", add_special_tokens=False)
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
    assert m.try_consume_tokens(ok) == len(ok)
    m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)  # (validate_tokens does not count max_tokens: the engine consumes)
    assert m.try_consume_tokens(head + think[:6]) == len(head) + 3  # the 4th thinking token must close it
