"""Experiment trackers: views of a run's records in TensorBoard, Weights & Biases and MLflow.

``metrics.jsonl`` and ``summary.json`` in the run directory stay the record of a run; a tracker
receives the same things as they are written: the run config when the run opens, every round's
numeric values (``base.round_scalars``: ``test-accuracy-mean``, ``train-loss-mean``, ``bytes-up``,
``round-seconds``, ...) at step = round, and the summary at the end. Each is switched on by its
run-config key (``tensorboard``, ``wandb``, ``mlflow``) and needs only its own package, which
the base install does not require (``pip install -e .[wandb]``, ``.[mlflow]``).

A tracker that fails mid-run (a lost connection) is switched off with a warning: the run and its
records go on. One that cannot start (package missing, bad setting) fails the run at start.
"""
