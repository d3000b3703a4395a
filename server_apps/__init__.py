"""The ServerApp: builds the method's strategy, runs the rounds, checkpoints, writes results."""
