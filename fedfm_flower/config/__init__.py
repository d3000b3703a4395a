"""The run configuration: its keys (``keys``), the checked run config (``experiment``), the
schema that writes pyproject's run config and the docs' tables (``schema``), overrides and
config files. Importing the package imports none of them."""
