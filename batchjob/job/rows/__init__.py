"""A row's way through the job: one record planned into engine requests (its prompt, chat messages and template,
images, tools, sampling: row_plan.py, the one place), the row loop that drives the engine (row_driver.py), and the
finished completions back into output columns (results.py); for files, the API and the Ray row server alike."""
