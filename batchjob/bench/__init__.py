"""The issue-7 benchmark harness: `make bench`, `batchjob bench`, `python -m batchjob.bench`.

workloads (W1-W3) -> systems (batchjob, HF transformers, vLLM; one process each, see worker/launch)
-> report (table, JSON, PNG); roofline times the matmul ceiling, pipeline times real `batchjob run` jobs."""
