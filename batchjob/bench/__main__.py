import sys

from batchjob.bench.run import main

sys.exit(main())
