"""HTTPS: the server's one `ssl.SSLContext`, built from `TLSSettings` and reloaded in place."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from gateway.settings import Reloadable, TLSSettings
from gateway.telemetry.metrics import TLS_RELOADS

VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

class TLSConfigError(ValueError):
    """The certificate, key or CA files cannot be used (at start: the gateway refuses to start)."""


class ServerTLS(Reloadable):
    """Reloads call `load_cert_chain` on the live context, so new connections get a renewed certificate without a
    restart; a pair that fails in a scratch context first is refused and the one in service stays. CA certificates
    are only added on reload (OpenSSL's store only grows)."""

    what = "tls"

    def __init__(self, settings: TLSSettings) -> None:
        if settings.cert_file is None:
            raise TLSConfigError("tls: no cert_file")
        self.settings = settings
        files = [f for f in (settings.cert_file, settings.key_file, settings.ca_file) if f is not None]
        super().__init__(files, settings.reload_interval_s, TLS_RELOADS)
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

    def apply(self) -> dict[str, Any]:
        self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))  # refused here, the live context is untouched
        self._load(self.context)
        return {"files": [str(f) for f in self.files]}

    def _load(self, context: ssl.SSLContext) -> None:
        s = self.settings
        assert s.cert_file is not None
        # without a password, an encrypted key fails instead of OpenSSL prompting on the terminal
        password: str | Callable[[], bytes] = s.key_password.get_secret_value() if s.key_password else bytes
        context.load_cert_chain(s.cert_file, s.key_file, password)
        if s.ca_file is not None:
            context.load_verify_locations(cafile=s.ca_file)
