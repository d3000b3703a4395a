"""``python -m fedfm_flower.report RUNS... --out DIR``: see ``fedfm_flower.report.build``."""

import sys

from fedfm_flower.report.build import main

sys.exit(main())
