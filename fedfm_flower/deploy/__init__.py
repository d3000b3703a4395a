"""Deploy the Flower App on this machine over loopback: one SuperLink, N SuperNodes, one run.

From the command line (``cli``; ``scripts/deploy_local.sh`` and ``scripts/deploy_local.py``
run the same):

    .venv/bin/python -m fedfm_flower.deploy --num-supernodes 2 \\
        --run-config "method='fedavg' num-server-rounds=3"

From Python (the deployment tests and ``bench.deployment_rounds`` do this):

    from fedfm_flower.deploy import DeployOptions, LocalDeployment

    with LocalDeployment(DeployOptions(num_supernodes=2)) as deployment:
        deployment.start()
        result = deployment.run({"method": "fedavg", "num-server-rounds": 2})

Step by step (docs/deployment.md explains each one), and the module that does it:

1. TLS certificates (CA + SuperLink certificate for 127.0.0.1/localhost) from
   ``scripts/generate_certs.sh`` and one ECDSA P-384 key pair per SuperNode, created in the work
   directory when missing (secure mode, the default; ``--insecure`` skips both):
   ``certificates``.
2. A ``flwr`` connection ``[superlink.fedfm-local]`` in ``<workdir>/flwr-home/config.toml``
   (address, root certificate or ``insecure = true``); ``FLWR_HOME`` points there for every
   process started here: ``connection`` (with the choice of free loopback ports).
3. ``flower-superlink`` on 127.0.0.1:<base-port> (Fleet, Control and Runtime APIs share it) with
   TLS, ``--enable-supernode-auth`` and a fresh ``--database`` in the work directory: ``local``.
4. Each SuperNode's public key is registered with ``flwr supernode register``: ``local``.
5. ``flower-supernode`` i = 0..N-1 with ``--superlink 127.0.0.1:<base-port>``,
   ``--root-certificates``, ``--auth-supernode-private-key``, its own runtime ``--port``
   (base-port + 1 + i) and ``--node-config "client-id=i partition-id=i num-partitions=N
   state-dir=<workdir>/node_i"``, started through ``python -m fedfm_flower.deploy.supernode``
   (Flower's SuperNode with short idle waits; ``--flower-waits``: plain ``flower-supernode``);
   the launcher waits until all N are online: ``local`` and ``supernode``.
6. ``flwr run <app> fedfm-local --stream --run-config <workdir>/run-config.toml`` (the merged
   overrides, always with ``num-clients=N``), then ``flwr ls --run-id`` for the final status:
   ``runs`` (run config, ``RunResult``) and ``LocalDeployment.run``.
7. Every process started here is stopped by process group (SIGTERM, then SIGKILL), and every
   process that carries this deployment's tag in its environment (SuperExec, ServerApp and
   ClientApp subprocesses, which Flower starts in new sessions) is found and stopped too; this
   runs on success, on error, on Ctrl-C and on SIGTERM/SIGHUP: ``processes`` and
   ``LocalDeployment.stop``.

``options`` holds ``DeployOptions``, the loopback address and ``DeploymentError``. Every process
gets ``OMP_NUM_THREADS`` = usable CPUs / (N + 1) (``--threads``), since N + 1 torch processes
share the cores. Logs (with wall-clock and elapsed-time stamps) go to ``<workdir>/logs/``. Only
127.0.0.1 is ever used.

Before anything starts, the merged run config is validated and checked
(``fedfm_flower.simulation.preflight``: resume target, existing results, weights file, partition
sizes); a problem is one line on stderr. The run's stream is shown with tracebacks folded
(``--debug`` shows them; the logs keep them). Exit status
(``fedfm_flower.simulation.verdict.ExitCode``): 0 run completed, 1 run failed or stopped, 2 bad
arguments or run config, 3 the deployment could not start, 124 ``--run-timeout`` reached, 130
interrupted.

Importing this package loads no torch and no Flower: ``tomli_w`` and ``cryptography`` are
imported when first needed, and Flower runs in the processes the launcher starts. Its exports
load their module on first use, so ``python -m fedfm_flower.deploy.superlink`` (``supernode``,
``superexec``) runs a module the package has not already imported.
"""

from __future__ import annotations

from fedfm_flower import lazy_getattr

_EXPORTS = {
    "CERT_FILES": "fedfm_flower.deploy.certificates",
    "ensure_certificates": "fedfm_flower.deploy.certificates",
    "ensure_supernode_keys": "fedfm_flower.deploy.certificates",
    "generate_supernode_key": "fedfm_flower.deploy.certificates",
    "build_parser": "fedfm_flower.deploy.cli",
    "main": "fedfm_flower.deploy.cli",
    "reserve_ports": "fedfm_flower.deploy.connection",
    "port_is_free": "fedfm_flower.deploy.connection",
    "write_flwr_config": "fedfm_flower.deploy.connection",
    "LocalDeployment": "fedfm_flower.deploy.local",
    "CONNECTION": "fedfm_flower.deploy.options",
    "DEFAULT_BASE_PORT": "fedfm_flower.deploy.options",
    "DeployOptions": "fedfm_flower.deploy.options",
    "DeploymentError": "fedfm_flower.deploy.options",
    "HOST": "fedfm_flower.deploy.options",
    "ManagedProcess": "fedfm_flower.deploy.processes",
    "become_subreaper": "fedfm_flower.deploy.processes",
    "tagged_pids": "fedfm_flower.deploy.processes",
    "RunConfigError": "fedfm_flower.deploy.runs",
    "RunResult": "fedfm_flower.deploy.runs",
    "parse_run_config": "fedfm_flower.deploy.runs",
    "resolve_run_config": "fedfm_flower.deploy.runs",
    "write_toml": "fedfm_flower.deploy.runs",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
