"""Where the run-config files live: ``configs/`` beside the package (setups, methods' keys per
setup, variants, transfer overlays, the papers' tables)."""

from __future__ import annotations

from pathlib import Path

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"
