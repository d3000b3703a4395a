"""``python -m fedfm_flower.sweep``: a sweep of cells (``fedfm_flower.study.sweep``)."""

import sys

from fedfm_flower.simulation.processes import exit_on_sigterm
from fedfm_flower.study.sweep import main

if __name__ == "__main__":
    exit_on_sigterm()  # a SIGTERM (timeout, scheduler) still shuts down the Ray instance
    sys.exit(main())
