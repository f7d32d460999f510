"""A job's options: the table that declares each one, reading and checking a job file, the flags and the API's
keywords into one JobConfig, the modes they take, the "auto" choices resolved once, and the fingerprint that says
whether a rerun is the same job."""
