"""What the README and the guide tell a newcomer to run names files that are there: every example job is listed in
running.md, and every `jobs/...` path the README and the guides mention exists (or is one of the placeholders a
reader replaces with their own job, or a file a shown command writes first)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {"jobs/big.toml", "jobs/my.toml", "jobs/job.toml", "jobs/nightly.toml",
                "jobs/data/adapters/smollm2-demo"}  # the last: written by jobs/data/make_lora_adapter.py, as lora.md says
PATH = re.compile(r"\bjobs/[A-Za-z0-9_./-]*[A-Za-z0-9_]")


def test_every_example_job_is_listed_in_the_running_guide():
    listed = set(re.findall(r"`(jobs/[a-z_]+\.toml)`", (REPO / "docs/guide/running.md").read_text()))
    assert {f"jobs/{p.name}" for p in (REPO / "jobs").glob("*.toml")} <= listed


def test_the_jobs_paths_the_readme_and_the_guides_name_exist():
    docs = [REPO / "README.md", *sorted((REPO / "docs/guide").glob("*.md")), *sorted((REPO / "jobs").glob("*.toml"))]
    named = {(m, d.relative_to(REPO)) for d in docs for m in PATH.findall(d.read_text())}
    missing = sorted((str(doc), path) for path, doc in named if path not in PLACEHOLDERS and not (REPO / path).exists())
    assert not missing


def test_the_readme_says_how_to_reach_the_installed_command():
    text = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in text and ".venv/bin/batchjob" in text
