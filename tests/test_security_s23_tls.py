"""Session 23 security finding: TLS files `serve` cannot use.

`serve --tls-key enc.pem` with a passphrase-protected key prompted "Enter PEM pass phrase:" on the
terminal (a start blocked there) or, without one, failed with `error: (no file named): Invalid
argument`; `--tls-key /dev/null` said "not found" of a file that exists. Each now is one line
naming the file and what to do, and the server never prompts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from appserver.cli.common import StartupError, explain
from appserver.cli.serve import check_tls_files
from tests.support.certs import self_signed
from tests.support.state import one_error_line, serve_refused


def _encrypted_copies(key_path: Path) -> tuple[Path, Path]:
    """The key encrypted with a pass phrase, as PKCS#8 (`ENCRYPTED PRIVATE KEY`) and in OpenSSL's
    traditional format (`Proc-Type: 4,ENCRYPTED`)."""
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    out = []
    for name, fmt in (
        ("enc.pem", serialization.PrivateFormat.PKCS8),
        ("legacy-enc.pem", serialization.PrivateFormat.TraditionalOpenSSL),
    ):
        path = key_path.parent / name
        path.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, fmt, serialization.BestAvailableEncryption(b"pass phrase"))
        )
        out.append(path)
    return out[0], out[1]


def test_serve_refuses_an_encrypted_key_in_one_line_without_prompting(home: Path, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    encrypted, _ = _encrypted_copies(key)
    r = serve_refused(home, "--auth", "token", "--tls-cert", str(cert), "--tls-key", str(encrypted))
    line = one_error_line(r)
    assert "pass phrase:" not in r.err  # OpenSSL's prompt
    assert f"the key file {encrypted} is encrypted" in line
    assert f"openssl pkey -in {encrypted}" in line


def test_serve_says_dev_null_is_no_regular_file(home: Path, tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    line = one_error_line(serve_refused(home, "--tls-cert", str(cert), "--tls-key", os.devnull))
    assert f"TLS key file {os.devnull} is not a regular file" in line


def test_each_unusable_tls_file_names_the_file_and_why(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    encrypted, legacy = _encrypted_copies(key)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.pem").write_bytes(b"")
    (tmp_path / "damaged-key.pem").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    (tmp_path / "damaged-cert.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cases: list[tuple[Path | str, Path | str, str]] = [
        (cert, legacy, f"the key file {legacy} is encrypted"),
        (cert, encrypted, f"the key file {encrypted} is encrypted"),
        (cert, tmp_path / "fifo", f"TLS key file {tmp_path / 'fifo'} is not a regular file"),
        (os.devnull, key, f"TLS certificate file {os.devnull} is not a regular file"),
        (tmp_path / "dir", key, f"TLS certificate file {tmp_path / 'dir'} is a directory"),
        (cert, tmp_path / "nope.pem", f"TLS key file not found: {tmp_path / 'nope.pem'}"),
        (cert, f"{cert}/key.pem", f"TLS key file {cert}/key.pem: Not a directory"),
        (cert, other_key, f"the key in {other_key} does not belong to the certificate in {cert}"),
        (key, cert, f"the certificate file {key} holds a private key and no certificate"),
        (cert, cert, f"the key file {cert} holds no PEM private key"),
        (tmp_path / "empty.pem", key, f"the certificate file {tmp_path / 'empty.pem'} holds no PEM certificate"),
        (cert, tmp_path / "damaged-key.pem", f"the key file {tmp_path / 'damaged-key.pem'} is damaged"),
        (tmp_path / "damaged-cert.pem", key, f"the certificate file {tmp_path / 'damaged-cert.pem'} is damaged"),
    ]
    for cert_arg, key_arg, expected in cases:
        with pytest.raises(StartupError) as info:
            check_tls_files(str(cert_arg), str(key_arg))
        assert expected in str(info.value), (cert_arg, key_arg, str(info.value))
        assert "--tls-key" in str(info.value)
    check_tls_files(str(cert), str(key))  # a good pair still loads


def test_an_os_error_naming_no_file_says_what_the_system_said() -> None:
    line = explain(OSError(errno.EINVAL, "Invalid argument"))
    assert line is not None and "no file named" not in line
    assert "Invalid argument (EINVAL)" in line and "--debug" in line
