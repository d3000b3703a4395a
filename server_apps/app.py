"""The one ServerApp of the Flower App; the method comes from the run config.

Imports inside functions keep ``flwr.common``, ``flwr.proto``, ``flwr.supercore``, ``numpy`` and
``torch`` out of this module's start-up.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.deploy.object_pushes import retry_grid_object_pushes
from fedfm_flower.records.logs import configure_logging

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, then run (or resume) the experiment."""
    from server_apps.polling import PromptGrid
    from server_apps.runner import run_experiment

    configure_logging()
    retry_grid_object_pushes(grid)
    config = ExperimentConfig.from_run_config(context.run_config)
    run_experiment(PromptGrid(grid) if config.prompt_replies else grid, config)
