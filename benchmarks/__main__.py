"""``python -m benchmarks``: the benchmark of benchmarks/run.py."""

import sys

from benchmarks.run import main

sys.exit(main())
