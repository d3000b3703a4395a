"""Deploy the Flower App on this machine over loopback: one SuperLink, N SuperNodes, one run.

    .venv/bin/python scripts/deploy_local.py --num-supernodes 2 \\
        --run-config "method='fedavg' num-server-rounds=3"

The command of ``scripts/deploy_local.sh``; the same as ``python -m fedfm_flower.deploy``. The
launcher itself is the library ``fedfm_flower.deploy`` (options, certificates, processes, the
deployment, runs; its command line is ``fedfm_flower.deploy.cli``). See docs/deployment.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's package, whatever else is on the path (another clone's PYTHONPATH, an
# installed copy): the deployment runs and writes into the checkout the script belongs to.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedfm_flower.deploy.cli import main  # noqa: E402 - after the path is this checkout's

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
