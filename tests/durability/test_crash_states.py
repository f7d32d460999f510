"""The crash-state simulator over whole jobs (tests/durability/crash_model.py has the rules): after every
operation a job persists, each state a power cut may leave is rebuilt as real files and recovered by
running the job (or the export) again. Nothing acknowledged may be lost, every row must come out once
with the uninterrupted run's text, the folder must verify and export, and no rerun may fail.

`make test` checks every distinct state of five jobs (over 500 states); `make crash` runs them over more rows
(BATCHJOB_CRASH_ROWS), so more parts and compactions."""
from __future__ import annotations

import os

from batchjob.io import sink
from tests.durability.harness import check_states, record
from tests.durability.jobs import scenarios


def test_every_crash_state_of_five_jobs_loses_nothing_and_recovers(model, inputs, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(sink, "COMPACT_MIN_BYTES", 1500)  # compactions happen inside the jobs too
    total, failures, per_job = 0, [], []
    only = os.environ.get("BATCHJOB_CRASH_ONLY", "")  # a name's part: one job, when debugging
    for i, scenario in enumerate(s for s in scenarios(model, inputs, reference) if only in s.name):
        recording = record(scenario, tmp_path / f"job-{i}", monkeypatch)
        outcome = check_states(scenario, recording, tmp_path / "states")
        total += outcome.states
        failures += outcome.failures
        per_job.append(f"{scenario.name}: {len(recording.ops)} operations, {outcome.states} states")
    print("; ".join(per_job))
    assert not failures, f"{len(failures)} of {total} crash states failed:\n" + "\n".join(failures[:20])
    assert total >= 500 or only, per_job
