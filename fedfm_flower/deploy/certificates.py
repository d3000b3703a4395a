"""Credentials of secure mode: the TLS certificates of the SuperLink and one key per SuperNode.

The CA and the SuperLink certificate (for 127.0.0.1/localhost) come from
``scripts/generate_certs.sh``; each SuperNode gets an ECDSA P-384 key pair whose public half is
registered with the SuperLink (``--enable-supernode-auth``). Both are created in the work
directory when missing; directories given by the user are only checked.

Imports inside functions keep ``cryptography`` out of this module's start-up.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fedfm_flower.deploy.options import ROOT, DeploymentError, DeployOptions

CERT_FILES = ("ca.crt", "server.crt", "server.key")


def ensure_certificates(options: DeployOptions) -> Path:
    """The certificate directory; generated when it is the default one and incomplete."""
    certs = options.certs
    missing = [name for name in CERT_FILES if not (certs / name).is_file()]
    if missing and options.certs_dir is None:
        script = ROOT / "scripts" / "generate_certs.sh"
        result = subprocess.run(
            ["bash", str(script), str(certs)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise DeploymentError(
                f"{script} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        missing = [name for name in CERT_FILES if not (certs / name).is_file()]
    if missing:
        raise DeploymentError(
            f"missing TLS file(s) {', '.join(str(certs / m) for m in missing)}; create them "
            f"with `scripts/generate_certs.sh {certs}` or pass --insecure (local debugging only)"
        )
    return certs


def generate_supernode_key(private_path: Path) -> None:
    """An ECDSA P-384 key pair in OpenSSH format (what `ssh-keygen -t ecdsa -b 384` writes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    private_path.with_suffix(".pub").write_bytes(public + f" {private_path.name}\n".encode())


def ensure_supernode_keys(options: DeployOptions) -> list[Path]:
    """Private key paths supernode_0..N-1 (public keys beside them, ``.pub``)."""
    keys = options.keys
    paths = [keys / f"supernode_{i}" for i in range(options.num_supernodes)]
    for path in paths:
        complete = path.is_file() and path.with_suffix(".pub").is_file()
        if not complete and options.keys_dir is None:
            generate_supernode_key(path)
        elif not complete:
            raise DeploymentError(
                f"missing SuperNode key {path} (or {path.name}.pub); create it with "
                f"`ssh-keygen -t ecdsa -b 384 -N '' -f {path}` or "
                f"`scripts/generate_certs.sh --supernode-keys {options.num_supernodes}`"
            )
    return paths
