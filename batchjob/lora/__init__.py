"""LoRA adapters per row (issue 37): PEFT adapters read and checked, and their deltas added beside the base model's
targeted matmuls for the rows that name them."""
