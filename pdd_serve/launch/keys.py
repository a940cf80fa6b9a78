"""The secrets a launched cluster needs, made once on the machine that runs `ray up`.

`python -m pdd_serve.launch secrets CONFIG` writes `.pdd/launch/` (the configs mount it on
every node as `~/.pdd/launch`): `ray_auth_token` (Ray token auth), `flight_token` (the KV Flight
bearer token), `api_keys` (HTTP API keys, one a line) and `tls/{ca.crt, md.crt, md.key}` (KV
Flight TLS: a CA and main decode's certificate for site b's host addresses, or for the name the
graph's `flight.tls_server_name` gives). Existing files are kept, so keys survive a re-run, except
a certificate that does not name those hosts, which is remade; the CA's key is deleted after
signing (keep your own elsewhere to sign again).
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
import tempfile
from pathlib import Path


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def _san(names: list[str]) -> str:
    out = []
    for n in names:
        try:
            ipaddress.ip_address(n)
            out.append(f"IP:{n}")
        except ValueError:
            out.append(f"DNS:{n}")
    return ",".join(out)


def make_tls(out: Path, names: list[str], days: int = 365) -> None:
    """A CA and an MD certificate whose SANs are `names` (addresses or DNS names), via openssl."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    with tempfile.TemporaryDirectory() as tmp:
        ca_key, csr, ext = Path(tmp) / "ca.key", Path(tmp) / "md.csr", Path(tmp) / "ext"
        ext.write_text(f"subjectAltName={_san(names)}\n")
        for cmd in (
            ["openssl", "req", "-x509", "-newkey", "rsa:3072", "-nodes", "-days", str(days), "-keyout", str(ca_key),
             "-out", str(out / "ca.crt"), "-subj", "/CN=pdd-ca"],
            ["openssl", "req", "-newkey", "rsa:3072", "-nodes", "-keyout", str(out / "md.key"), "-out", str(csr),
             "-subj", "/CN=pdd-md"],
            ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(out / "ca.crt"), "-CAkey", str(ca_key),
             "-CAcreateserial", "-CAserial", str(Path(tmp) / "ca.srl"), "-days", str(days), "-out",
             str(out / "md.crt"), "-extfile", str(ext)],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd[:3])} ...` failed: {r.stderr.strip()[-300:]}")
    for f in ("ca.crt", "md.crt", "md.key"):
        (out / f).chmod(0o600)


def make_secrets(out_dir: str | Path, md_names: list[str]) -> list[str]:
    """Make what is missing under out_dir; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    made = []
    for name, value in (("ray_auth_token", secrets.token_hex(32)), ("flight_token", secrets.token_urlsafe(32)),
                        ("api_keys", "sk-" + secrets.token_urlsafe(32))):
        if not (out / name).exists():
            _write(out / name, value + "\n")
            made.append(name)
    tls = out / "tls"
    complete = all((tls / f).exists() for f in ("ca.crt", "md.crt", "md.key"))
    # a certificate for other hosts (the config's addresses changed) would fail the KV stream's TLS
    # handshake at the first transfer, far from the cause: remake it now
    if not complete or not set(_san(md_names).split(",")) <= cert_names(tls / "md.crt"):
        make_tls(tls, md_names)
        made += ["tls/ca.crt", "tls/md.crt", "tls/md.key"]
    return made


def cert_names(cert: Path) -> set[str]:
    """The subjectAltName entries of a certificate, as `IP:a.b.c.d` / `DNS:name` (empty if unreadable)."""
    r = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"], capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        return set()
    lines = r.stdout.splitlines()[1:]  # after "X509v3 Subject Alternative Name:"
    return {n.strip().replace("IP Address:", "IP:") for ln in lines for n in ln.split(",") if n.strip()}


__all__ = ["cert_names", "make_secrets", "make_tls"]
