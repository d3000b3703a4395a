"""A ClientApp module whose import ends the process (exit status 3): tests/test_fork_engine.py
loads it in a forked worker, never in the test process."""

import os

os._exit(3)
