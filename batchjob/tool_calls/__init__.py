"""Tool calls in batch (issue 36): a row's tools and tool_choice, the call syntax each family writes (its parser and,
for `required` or a named function, the grammar that keeps decoding inside it)."""
