"""batchjob: offline batch LLM inference with a continuous-batching engine and checkpoint-resume."""

__version__ = "0.1.0"
