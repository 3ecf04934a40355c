"""HTTPS: the server's one `ssl.SSLContext`, built from `TLSSettings` and reloaded in place."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gateway.settings import TLSSettings
from gateway.telemetry.metrics import TLS_RELOADS

log = structlog.get_logger(__name__)

VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

Stamp = tuple[tuple[int, int, int] | None, ...]


class TLSConfigError(ValueError):
    """The certificate, key or CA files cannot be used (at start: the gateway refuses to start)."""


class ServerTLS:
    """Reloads call `load_cert_chain` on the live context, so new connections get a renewed certificate without a
    restart; a pair that fails in a scratch context first is refused and the one in service stays. CA certificates
    are only added on reload (OpenSSL's store only grows)."""

    def __init__(self, settings: TLSSettings) -> None:
        if settings.cert_file is None:
            raise TLSConfigError("tls: no cert_file")
        self.settings = settings
        self._stamp = self._files_stamp()
        self._refused: Stamp | None = None
        self._next_poll = time.monotonic() + settings.reload_interval_s
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = VERSIONS[settings.min_version]
        self.context.verify_mode = CLIENT_AUTH[settings.client_auth]
        try:
            self._load(self.context)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise TLSConfigError(f"tls: cannot use {', '.join(map(str, self.files))}: {exc}") from exc

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn is given the context, not file names: it would build its own once and never read the files again."""
        return {"ssl_context_factory": lambda config, default: self.context}

    @property
    def files(self) -> list[Path]:
        s = self.settings
        return [f for f in (s.cert_file, s.key_file, s.ca_file) if f is not None]

    def reload(self, reason: str) -> bool:
        stamp = self._files_stamp()
        try:
            self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))  # refused here, the live context is untouched
            self._load(self.context)
        except (OSError, ValueError) as exc:
            self._refused = stamp
            TLS_RELOADS.labels(result="error").inc()
            log.error("tls_reload_failed", reason=reason, error=str(exc), files=[str(f) for f in self.files])
            return False
        self._stamp, self._refused = stamp, None
        TLS_RELOADS.labels(result="ok").inc()
        log.info("tls_reloaded", reason=reason, files=[str(f) for f in self.files])
        return True

    def poll(self) -> None:
        """Reload when a file changed since the last load (at most every `reload_interval_s`)."""
        interval = self.settings.reload_interval_s
        now = time.monotonic()
        if interval <= 0 or now < self._next_poll:
            return
        self._next_poll = now + interval
        stamp = self._files_stamp()
        if stamp != self._stamp and stamp != self._refused:
            self.reload("files changed")

    def _load(self, context: ssl.SSLContext) -> None:
        s = self.settings
        assert s.cert_file is not None
        # without a password, an encrypted key fails instead of OpenSSL prompting on the terminal
        password: str | Callable[[], bytes] = s.key_password.get_secret_value() if s.key_password else bytes
        context.load_cert_chain(s.cert_file, s.key_file, password)
        if s.ca_file is not None:
            context.load_verify_locations(cafile=s.ca_file)

    def _files_stamp(self) -> Stamp:
        """What tells a changed file: mtime, size and inode (a Secret volume swaps a symlink)."""
        stamps: list[tuple[int, int, int] | None] = []
        for path in self.files:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)
