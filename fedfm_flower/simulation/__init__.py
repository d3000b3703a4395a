"""Running the app: the simulation launcher (``python -m fedfm_flower.simulation``, ``launcher``),
the engines its clients run in (forked workers, Ray actors, prompt hand-offs), and what both
launchers share (Flower's processes, the app's staged files, preflight checks, waits)."""
