"""Structured outputs: a row's output constrained to a JSON schema, any JSON object, a regex, a choice of strings
or a Lark/GBNF grammar (llguidance; docs/design/structured-outputs.md).

spec.py (what a row asks, parsed and canonical) -> grammar.py (compiled once per spec, off the engine step)
-> matcher.py (one matcher per completion; the batch's next-token bitmask) -> mask.py (bitmask onto logits).
"""
from batchjob.engine.structured.grammar import (
    CompiledGrammar,
    GrammarCache,
    GrammarState,
    GrammarStatus,
    GrammarTokenizer,
    compile_grammar,
)
from batchjob.engine.structured.mask import apply_token_bitmask_, unpack_bitmask
from batchjob.engine.structured.matcher import ALL_ALLOWED, MaskFiller, Matcher
from batchjob.engine.structured.spec import (
    StructuredOutputs,
    StructuredOutputsError,
    from_response_format,
    parse_structured_outputs,
)

__all__ = [
    "ALL_ALLOWED",
    "CompiledGrammar",
    "GrammarCache",
    "GrammarState",
    "GrammarStatus",
    "GrammarTokenizer",
    "MaskFiller",
    "Matcher",
    "StructuredOutputs",
    "StructuredOutputsError",
    "apply_token_bitmask_",
    "compile_grammar",
    "from_response_format",
    "parse_structured_outputs",
    "unpack_bitmask",
]
