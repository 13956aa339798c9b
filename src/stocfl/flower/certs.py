"""Certificates for Flower's secure mode (TLS between SuperNodes, `flwr` and the SuperLink).

``make_certificates`` writes a private certificate authority and a SuperLink certificate it
signed, valid for the given host names and IP addresses:

- ``ca.crt``: give it to every SuperNode (``--root-certificates``) and to ``flwr``
  (``root-certificates`` in ``$FLWR_HOME/config.toml``);
- ``server.pem``, ``server.key``: the SuperLink's (``--ssl-certfile``, ``--ssl-keyfile``, with
  ``--ssl-ca-certfile ca.crt``);
- ``ca.key``: keep it off the federation's machines; it signs further certificates.

For a federation across organisations use certificates from a CA the parties trust instead.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from stocfl.errors import UserError

FILES = ("ca.crt", "ca.key", "server.pem", "server.key")


def make_certificates(
    directory: str | Path,
    hosts: list[str] | tuple[str, ...] = ("127.0.0.1", "localhost"),
    days: int = 365,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write ``FILES`` into ``directory`` (created); the server certificate names ``hosts``.

    Returns the path of each file by name. Refuses to replace existing files unless
    ``overwrite``: a new CA would lock out every SuperNode holding the old ``ca.crt``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise UserError(
            "certificates need at least one host name or IP address of the SuperLink, e.g. --host 127.0.0.1"
        )
    if not 1 <= days <= 36500:
        raise UserError(f"certificate validity {days} days: expected 1 to 36500 days (--days)")
    for host in hosts:
        if not 1 <= len(host) <= 64 or any(c.isspace() or not c.isprintable() for c in host):
            raise UserError(f"--host {host!r}: expected a host name or IP address of 1 to 64 printable characters")
    out = Path(directory)
    paths = {name: out / name for name in FILES}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise UserError(
            f"{existing[0]} exists; pick another directory or pass --overwrite (a new CA locks out the "
            f"SuperNodes that hold the old ca.crt)"
        )
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stocfl federation CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    out.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    key_bytes = {
        k: key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        for k, key in (("ca.key", ca_key), ("server.key", server_key))
    }
    for name, data in (
        ("ca.crt", ca_cert.public_bytes(pem)),
        ("server.pem", server_cert.public_bytes(pem)),
        *key_bytes.items(),
    ):
        fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if name.endswith(".key") else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(paths[name], 0o600 if name.endswith(".key") else 0o644)  # also when overwriting
    return paths
