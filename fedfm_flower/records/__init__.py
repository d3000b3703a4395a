"""What a run writes and sends: durable files, the run directory (``results``), message records
and packed arrays, the message protocol's names, client state, logs, tracebacks and the
trackers. The lowest layer but one: it imports nothing of the package above the config."""
