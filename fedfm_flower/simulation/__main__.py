"""``python -m fedfm_flower.simulation``: the simulation launcher (``launcher``)."""

import sys

from fedfm_flower.simulation.launcher import main

sys.exit(main())
