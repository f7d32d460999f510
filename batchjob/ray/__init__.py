"""`batchjob ray submit`: a job's shards on a Ray cluster (docs/guide/ray.md). The driver's side is submit.py (plan,
progress, stop) and runners.py (actors or tasks); what runs on the workers is worker.py. Ray itself is an optional
dependency, imported (as the top-level `ray`) only when a submission starts."""
