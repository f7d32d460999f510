"""The generated reference pages: docs/reference/run-options.md from the options table (job/options/options.py, its
flags: run_options.py), `python -m batchjob.cli.reference > docs/reference/run-options.md`; and
docs/reference/models.md from the model registry, `python -m batchjob.cli.reference models > ...`. A test fails
when a committed page differs from what this prints."""
from __future__ import annotations

import click

from batchjob.cli.run_options import RUN_OPTIONS, RunOption
from batchjob.job.options.config import FIELDS, TABLES

HEADER = """# `batchjob run` options

Generated from the options table (`batchjob/job/options/options.py`) by `python -m batchjob.cli.reference`; do not
edit by hand. Every option is also a job-file key: the flag overrides the file. A flag marked repeatable names a
list: `--stop a --stop b` is the list of both (as vLLM's repeated `--lora-modules` entries), and it replaces the
job file's list rather than adding to it. A key stands at the top level of the job file or in its table
(`[sampling]`, `[structured_outputs]`, `[embed]`, `[engine]`, `[output]`, `[lora]`); a key in another table is an
error.
`[[lanes]]` tables are described in [the scheduling guide](../guide/scheduling.md).
"""

SECTION_TITLES = {"job": "The job: model, input, prompts, run control", "sampling": "Sampling (`[sampling]`)",
                  "structured_outputs": "Structured outputs for every row (`[structured_outputs]`; at most one)",
                  "embed": "Embeddings, `task = \"embed\"` (`[embed]`; [the guide](../guide/embeddings.md))",
                  "engine": "Engine (`[engine]`)", "output": "Output (`[output]`)",
                  "lora": "LoRA adapters (`[lora]`; [the guide](../guide/lora.md))"}


def table_of(field: str) -> str:
    return next((table for table, fields in TABLES.items() if field in fields), "job")


def value_of(opt: RunOption) -> str:
    return _value_of(opt) + (", repeatable" if opt.repeatable else "")


def _value_of(opt: RunOption) -> str:
    if opt.type is None:
        return "true / false"
    if isinstance(opt.type, click.Choice):
        return " \\| ".join(f"`{c}`" for c in opt.type.choices)
    if isinstance(opt.type, (click.IntRange, click.FloatRange)):
        return opt.type.to_info_dict()["param_type"].removesuffix("Range").lower() + f" ({opt.type._describe_range()})"
    return {str: "text", int: "integer", float: "number"}[opt.type]


def render() -> str:
    out = [HEADER]
    for section, title in SECTION_TITLES.items():
        rows = [o for o in RUN_OPTIONS if table_of(o.field) == section]
        out.append(f"\n## {title}\n\n| flag | job-file key | value | what it does |\n|---|---|---|---|")
        for o in rows:
            key = o.field if section == "job" else f"{section}.{o.field}"
            help_ = o.help.replace("|", "\\|")
            out.append(f"| `{o.flag}` | `{key}` | {value_of(o)} | {help_} |")
    also = sorted(f for f in FIELDS if f not in {o.field for o in RUN_OPTIONS})
    out.append("\nJob-file keys without a flag: " + ", ".join(f"`{f}`" for f in also) + ".\n")
    return "\n".join(out)


def render_models() -> str:
    from batchjob.models.registry import FAMILIES

    out = ["# Supported models", "",
           "Generated from the model registry (`batchjob/models/registry.py`) by `python -m batchjob.cli.reference models`;",
           "do not edit by hand. A model folder's `config.json` `architectures` (or `model_type`), or a GGUF file's",
           "`general.architecture`, picks the family; anything else is refused with one line listing these.", "",
           "| family | HF architectures | GGUF architectures |", "|---|---|---|"]
    for fam in FAMILIES:
        gguf = ", ".join(f"`{a}`" for a in fam.gguf_architectures) if fam.parse_gguf is not None else "-"
        out.append(f"| {fam.name} | {', '.join(f'`{a}`' for a in fam.hf_architectures)} | {gguf} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    print(render_models() if sys.argv[1:] == ["models"] else render(), end="")
