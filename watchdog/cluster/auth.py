"""Authenticated store values: the shared secret file and the HMAC-SHA256 envelope.

Any process that can reach the job's TCPStore can write to it. With a secret (``--store-secret-file``,
the same file on every node) every value rankwatch writes is sealed, and a value that does not carry a
valid MAC is rejected like a malformed one. The envelope is a short ASCII prefix in front of the JSON
document, so the document is never re-encoded::

    rankwatch.signed/1 <64 hex digits of HMAC-SHA256>\\n<the JSON document>

The MAC covers the envelope version, the job id, the store key the value was written under (both
length-prefixed) and the document bytes, so a sealed value cannot be replayed under another key (a
node's evidence as a verdict, ``incident/1`` as ``incident/2``) or in another job sharing the store
or the secret. Comparison is constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from ..errors import UserError

SIGNED_SCHEMA = "rankwatch.signed/1"
_PREFIX = SIGNED_SCHEMA + " "
_MAC_HEX = 64  # hex digits of an HMAC-SHA256
SECRET_MIN_BYTES = 16  # 128 bits: below that a secret can be guessed
SECRET_MAX_BYTES = 4096  # a secret, not a file that happens to be there


class EnvelopeError(Exception):
    """A value is not sealed, or its MAC does not match (forged, replayed, or another secret)."""


def _message(job_id: str, key: str, body: bytes) -> bytes:
    job, k = job_id.encode("utf-8"), key.encode("utf-8")
    return b"%s\n%d:%s\n%d:%s\n" % (SIGNED_SCHEMA.encode(), len(job), job, len(k), k) + body


def mac_hex(secret: bytes, job_id: str, key: str, body: bytes) -> str:
    return hmac.new(secret, _message(job_id, key, body), hashlib.sha256).hexdigest()


def seal(secret: bytes, job_id: str, key: str, text: str) -> str:
    """``text`` (a JSON document) in its envelope for ``key`` of ``job_id``."""
    return f"{_PREFIX}{mac_hex(secret, job_id, key, text.encode('utf-8'))}\n{text}"


def is_sealed(raw: bytes) -> bool:
    return raw.startswith(_PREFIX.encode())


def unseal(secret: bytes, job_id: str, key: str, raw: bytes) -> bytes:
    """The document inside a value read from ``key``; EnvelopeError unless it was sealed for exactly that
    key and job under this secret."""
    if not is_sealed(raw):
        raise EnvelopeError("unauthenticated value (not signed with the store secret)")
    head = len(_PREFIX)
    given = raw[head : head + _MAC_HEX]
    if len(raw) < head + _MAC_HEX + 1 or raw[head + _MAC_HEX : head + _MAC_HEX + 1] != b"\n":
        raise EnvelopeError("malformed signed value")
    body = raw[head + _MAC_HEX + 1 :]
    expected = mac_hex(secret, job_id, key, body).encode()
    if not hmac.compare_digest(given, expected):
        raise EnvelopeError("signature does not match (forged, replayed from another key or job, or another secret)")
    return body


def load_secret(path: str) -> bytes:
    """The shared secret from ``path``; UserError (one line, exit 2) unless it is a regular file owned by
    this user or root, not readable or writable by group or others, of 16 bytes to 4 KiB (one trailing
    newline stripped). Symlinks are followed (Kubernetes mounts Secrets through them); the file they lead
    to is what is checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserError(f"--store-secret-file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"--store-secret-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise UserError(
                f"--store-secret-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read it; "
                f"chmod 0600 (or 0400) it"
            )
        if st.st_uid not in (os.geteuid(), 0):
            raise UserError(f"--store-secret-file {path}: owned by uid {st.st_uid}, not by this user or root")
        data = b""
        while len(data) <= SECRET_MAX_BYTES + 2:
            chunk = os.read(fd, SECRET_MAX_BYTES + 3 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise UserError(f"--store-secret-file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not SECRET_MIN_BYTES <= len(data) <= SECRET_MAX_BYTES:
        size = f"{len(data)} bytes" if len(data) <= SECRET_MAX_BYTES else f"over {SECRET_MAX_BYTES} bytes"
        raise UserError(
            f"--store-secret-file {path}: {size}; a secret has {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} "
            "(e.g. head -c 32 /dev/urandom | base64)"
        )
    return data
