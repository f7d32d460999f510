"""`python -m batchjob ...`: the same command line as `batchjob ...`."""
from batchjob.cli.main import main

if __name__ == "__main__":
    main(prog_name="batchjob")
