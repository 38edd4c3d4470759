"""TLS for tests: the ``certificates`` fixture (module-scoped) makes a throw-away CA and a server
certificate for 127.0.0.1 it signed, with the ``openssl`` command (``make openssl``). A test module uses it
with ``from tls import certificates``."""

import subprocess
from pathlib import Path

import pytest


LEAF_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The CA's certificate, the server's certificate and its key (EC P-256: quick to make)."""
    folder = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kilnproxy test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "leaf.ext").write_text(LEAF_EXTENSIONS)
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "leaf.ext")
    return folder / "ca.pem", folder / "server.pem", folder / "server.key"
