"""What a running job tells its operator: the start line and the summary, the progress bar or lines, and the
per-step stats file."""
