"""``python -m fedfm_flower.deploy``: the local deployment launcher (``cli``)."""

import sys

from fedfm_flower.deploy.cli import main

sys.exit(main(prog="python -m fedfm_flower.deploy"))
