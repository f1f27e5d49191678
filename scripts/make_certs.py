"""Writes a private CA and one certificate signed by it, for splitserve's mutual TLS (a try-out, tests,
a small deployment; in production use your PKI or cert-manager). Needs the `cryptography` package (the
`test` extra).

    python scripts/make_certs.py --out deploy/secrets            # the names of deploy/ (compose and k8s)
    python scripts/make_certs.py --out certs --name my-host --name 10.0.0.7

Writes ca.crt, tls.crt, tls.key (the layout of a Kubernetes TLS Secret with its CA, as cert-manager writes
it) and, for a new CA, ca.key (keep it apart: it signs more certificates, `--ca-dir DIR` reuses it). The certificate is both a
server and a client certificate (every splitserve process serves and calls), and names 127.0.0.1 and
localhost for health checks from inside a container.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Every name a splitserve process is reached by in deploy/: compose services, Kubernetes Services and pods.
DEPLOY_NAMES = [
    "localhost", "127.0.0.1",
    "scheduler", "scheduler-cpu", "worker-0", "worker-1", "worker-cpu",  # docker-compose.yml
    "splitserve-scheduler", "splitserve-scheduler.splitserve", "splitserve-scheduler.splitserve.svc",  # k8s
    "*.splitserve-worker", "*.splitserve-worker.splitserve", "*.splitserve-worker.splitserve.svc",
]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "splitserve CA", days: int = 3650) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new self-signed CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_cert(ca_cert_pem: bytes, ca_key_pem: bytes, names: list[str], common_name: str = "splitserve",
              days: int = 365) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by the CA, for these DNS names and IP addresses, usable as server
    and as client certificate."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    alt = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def write(out: Path, names: list[str], ca_dir: Path | None = None, common_name: str = "splitserve") -> dict[str, Path]:
    """ca.crt, tls.crt, tls.key in `out`, and ca.key when the CA is new (not that of ca_dir); returns their
    paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    if ca_dir is not None:
        ca_cert, ca_key = (ca_dir / "ca.crt").read_bytes(), (ca_dir / "ca.key").read_bytes()
    else:
        ca_cert, ca_key = make_ca()
        files.append(("ca.key", ca_key, 0o600))
    cert, key = make_cert(ca_cert, ca_key, names, common_name)
    paths = {}
    for name, data, mode in [("ca.crt", ca_cert, 0o644), *files, ("tls.crt", cert, 0o644), ("tls.key", key, 0o600)]:
        path = paths[name] = out / name
        path.write_bytes(data)
        os.chmod(path, mode)
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder to write the files into")
    p.add_argument("--name", action="append", default=[], metavar="NAME",
                   help="a DNS name or IP address the certificate is for; repeatable (default: deploy/'s names)")
    p.add_argument("--ca-dir", type=Path, help="sign with the ca.crt / ca.key found here instead of a new CA")
    p.add_argument("--common-name", default="splitserve")
    args = p.parse_args()
    paths = write(args.out, args.name or DEPLOY_NAMES, args.ca_dir, args.common_name)
    print("\n".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
