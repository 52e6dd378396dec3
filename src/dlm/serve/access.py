"""Who may use `dlm serve` (an ASGI middleware around the app). On a loopback address the server answers only to a
loopback Host with its own port, so that a web page the operator opens cannot reach it under the page's own name
after pointing that name at 127.0.0.1 (DNS rebinding); `--allowed-hosts` adds names. With an API key, every /v1
request must send `Authorization: Bearer KEY`; / and /health stay open."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import JSONResponse

from dlm.errors import DlmError
from dlm.serve.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether a bind address is this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port) of a Host header or an --allowed-hosts entry ("name", "name:port", "[::1]:port"); None: bad."""
    name, port = value.strip().lower(), None
    if not name.endswith("]") and ":" in name:
        name, _, digits = name.rpartition(":")
        if not digits.isdigit():
            return None
        port = int(digits)
    return (name, port) if name else None


def rules(host: str, allowed_hosts=(), api_key: str | None = None) -> dict:
    """`Access`'s settings from `dlm serve`'s --host, --allowed-hosts and --api-key, checked."""
    names = [h for h in allowed_hosts if h != "*"]
    allowed = [split_host(h) for h in names]
    if None in allowed:
        bad = names[allowed.index(None)]
        raise DlmError(f"--allowed-hosts: {bad!r} is not a host name, name:port or [IPv6]:port")
    if api_key is not None and not api_key.strip():
        raise DlmError("the API key (--api-key or DLM_API_KEY) is empty: give a key, or neither to serve without one")
    return {"check_host": "*" not in allowed_hosts and (is_loopback(host) or bool(allowed)), "allowed": allowed,
            "key": api_key.encode() if api_key is not None else None}


class Access:
    """403 for a request whose Host this server does not answer to; 401 for a /v1 request without the API key.
    `check_host`, `allowed` and `key` come from `rules`."""

    def __init__(self, app, check_host: bool, allowed: list, key: bytes | None):
        self.app, self.check_host, self.allowed, self.key = app, check_host, allowed, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                headers = {"Connection": "close"}
                if refused.status == 401:
                    headers["WWW-Authenticate"] = "Bearer"
                await JSONResponse(refused.body(), refused.status, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:  # the first of each name, as the app reads them
            headers.setdefault(name, value)
        if self.check_host and b"host" in headers:  # a browser always sends Host; HTTP/1.0 tools may not
            value = headers[b"host"].decode("latin-1")
            port = (scope.get("server") or (None, None))[1]
            if not self._host_allowed(split_host(value), port):
                shown = repr(value) if len(value) <= 80 else repr(value[:77] + "...")
                return ApiError(403, f"Host {shown} is not a name this server answers to: use localhost, 127.0.0.1 "
                                f"or [::1] with port {port} (dlm serve --allowed-hosts adds names)", None,
                                "host_not_allowed")
        path = scope["path"]
        if self.key is not None and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return ApiError(401, "this server needs an API key: send Authorization: Bearer KEY (the key given "
                                "to dlm serve --api-key or DLM_API_KEY)", None, "missing_api_key")
            if not hmac.compare_digest(token.strip(), self.key):
                return ApiError(401, "the API key is wrong (Authorization: Bearer KEY must send the key given to "
                                "dlm serve --api-key or DLM_API_KEY)", None, "invalid_api_key")
        return None

    def _host_allowed(self, host: tuple[str, int | None] | None, port: int | None) -> bool:
        if host is None:
            return False
        name, given = host
        if name in LOOPBACK_NAMES and (given == port or given is None and port == 80):
            return True
        return any(name == n and (p is None or p == given) for n, p in self.allowed)
