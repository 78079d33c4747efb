"""`python -m rbs_bench.tables`: build every table of a results directory (build.py)."""

import sys

from rbs_bench.tables.build import main

sys.exit(main())
