"""Structured outputs: a row's output constrained to a JSON schema, any JSON object, a regex, a choice of strings
or a Lark/GBNF grammar (llguidance; docs/design/structured-outputs.md).

spec.py (what a row asks, parsed and canonical) -> grammar.py (compiled once per spec, off the engine step)
-> matcher.py (one matcher per completion; the batch's next-token bitmask) -> mask.py (bitmask onto logits).
Import from the module that defines a name: spec.py stays light (no torch), so a job's options are checked
before torch is imported (job/process/preflight.py).
"""
