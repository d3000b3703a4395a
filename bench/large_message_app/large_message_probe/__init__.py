"""A probe Flower App: a LoRA adapter of a 7B model's size through a real deployment.

``payload`` builds the adapter (r = ``lora-rank`` on q and v of 32 layers of width 4,096:
about 134 MB in float32 at r = 64, synthetic values from ``seed``); the ServerApp (``server``)
sends it to every node through fedfm-flower's records, each ClientApp (``client``) checks it
against the spec as a strategy checks a reply, adds 1 and sends it back, and the ServerApp
checks the echo exactly and writes the times and peak memory to
``<output-dir>/<run-name>/large_messages.json``. Flower splits each array into chunks
(``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``, 5 MiB) on the way.
"""
