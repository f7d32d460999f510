"""A job cut into shards, each run by its own process or machine: the shards' row ranges and their folders, reading a
sharded output back, its progress, and Slurm arrays of shards. Below the job: launch/ and ray/ start the shards."""
