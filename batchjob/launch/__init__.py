"""Launchers above the job: a long-lived process that runs shards (shard_worker.py), the driver loop that hands
them out and follows their progress (driver.py), and data parallel on this node's devices (local.py). Ray's launcher
(batchjob/ray/) uses the first two."""
