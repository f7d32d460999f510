"""docs/reference/run-options.md is the options table, generated: a flag added, renamed or reworded without
regenerating the page fails here."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.cli.reference import render, render_models
from batchjob.cli.run_options import RUN_OPTIONS
from batchjob.job.options.config import FIELDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "run-options.md"


def test_the_committed_reference_is_the_generated_one():
    assert PAGE.read_text() == render(), "regenerate: python -m batchjob.cli.reference > docs/reference/run-options.md"


def test_every_job_field_has_a_flag_and_every_flag_is_in_the_help():
    assert {o.field for o in RUN_OPTIONS} == set(FIELDS) - {"lanes"}
    help_text = CliRunner().invoke(main, ["run", "--help"], terminal_width=400).output
    assert all(o.flag.split("/")[0] in help_text for o in RUN_OPTIONS)


def test_the_supported_models_page_is_the_registrys():
    page = PAGE.parent / "models.md"
    assert page.read_text() == render_models(), "regenerate: python -m batchjob.cli.reference models > docs/reference/models.md"
