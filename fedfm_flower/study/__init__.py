"""Studies over many runs: sweeps of cells (``sweep``, ``cells``, ``pools``), tuning studies
(``tune``: search spaces, pruning, selection, state and status), the papers' tables and the
statistics the reports test with. The commands keep their names at the package's top:
``python -m fedfm_flower.tune``, ``.sweep``, ``.study_status``."""
