"""`max_errors`: how many failed rows a job takes before it stops (exit 1, everything done committed)."""
from __future__ import annotations

import math


class TooManyErrors(Exception):
    """More rows failed than `max_errors` allows."""


class AllRowsFailed(TooManyErrors):
    """Every row of the job failed: the job did nothing useful, whatever `max_errors` allows."""


class ErrorBudget:
    """`max_errors`: a row count (10) or a fraction of the rows (0.1). A fraction counts against the
    input's rows when their number is known, else against the rows done so far once there are 100."""

    def __init__(self, max_errors: int | float | None, total_rows: int | None) -> None:
        self.max_errors = max_errors
        self.total_rows = total_rows

    def limit(self, rows_done: int, final: bool = False) -> int | None:
        m = self.max_errors
        if m is None:
            return None
        if isinstance(m, int):
            return m
        if self.total_rows is not None:
            return math.floor(m * self.total_rows)
        if rows_done < 100 and not final:
            return None  # too few rows to judge a fraction yet
        return math.floor(m * rows_done)

    def check(self, errors: int, rows_done: int, final: bool = False) -> None:
        limit = self.limit(rows_done, final)
        if limit is not None and errors > limit:
            what = f"{self.max_errors:g} of the rows, {limit}" if isinstance(self.max_errors, float) else str(limit)
            raise TooManyErrors(f"{errors} rows failed, more than max_errors allows ({what}); everything done so "
                                "far is committed — the `error` column says why each row failed (batchjob export "
                                "OUT --to FILE --partial). Fix the input, or raise --max-errors and rerun to continue")


def job_failure(max_errors: int | float | None, total_rows: int | None, output: str, rows: int, errors: int,
                first_error: str | None, rerun: bool = False) -> TooManyErrors | None:
    """How a job whose rows are all in ended: every row failed, or more than max_errors (the same verdict on a
    rerun of a finished job, with the max_errors it is run with now); None when it succeeded."""
    if rows and errors == rows:
        again = "already finished, and " if rerun else ""
        return AllRowsFailed(f"{again}every row failed ({errors:,} of {rows:,}; committed in {output}); "
                             f"the first error: {first_error or 'see the error column'}")
    try:
        ErrorBudget(max_errors, total_rows).check(errors, rows, final=True)
    except TooManyErrors as e:
        return TooManyErrors(f"already finished, and {e}") if rerun else e
    return None
