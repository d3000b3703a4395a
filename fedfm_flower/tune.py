"""``python -m fedfm_flower.tune``: a tuning study (``fedfm_flower.study.tune``)."""

import sys

from fedfm_flower.simulation.processes import exit_on_sigterm
from fedfm_flower.study.tune import main

if __name__ == "__main__":
    exit_on_sigterm()  # a SIGTERM (timeout, scheduler) still shuts down the Ray instance
    sys.exit(main())
