"""`dlm serve`'s access rules without a server: the Host check (DNS rebinding) and the API key, as the ASGI
middleware answers a request scope, with the exact status, error code, message and headers a client sees."""

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from dlm.errors import DlmError  # noqa: E402
from dlm.serve.access import Access, is_loopback, rules, split_host  # noqa: E402


def call(access: Access, path="/v1/models", host: str | None = "localhost:8000", port=8000, headers=(),
         kind="http"):
    """(status, JSON body, headers) that `access` answers to one request; (0, None, {}) if it passed it on."""
    sent, passed = [], []

    async def app(scope, receive, send):
        passed.append(scope)

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    access.app = app
    raw = ([(b"host", host.encode("latin-1"))] if host is not None else []) + [
        (k.lower().encode(), v.encode("latin-1")) for k, v in headers]
    scope = {"type": kind, "path": path, "headers": raw, "server": ("127.0.0.1", port) if port else None,
             "method": "GET", "query_string": b"", "root_path": ""}
    asyncio.run(access(scope, receive, send))
    if passed:
        return 0, None, {}
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], json.loads(body), {k.decode(): v.decode() for k, v in start["headers"]}


def made(host="127.0.0.1", allowed_hosts=(), api_key=None) -> Access:
    return Access(None, **rules(host, allowed_hosts, api_key))


def test_loopback_addresses_and_host_values():
    for host in ("localhost", "LOCALHOST", "127.0.0.1", "127.3.4.5", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "192.168.1.2", "::", "example.org", "localhost.example", "", "X127.0.0.1"):
        assert not is_loopback(host), host
    assert split_host("LocalHost:8000") == ("localhost", 8000)
    assert split_host(" box ") == ("box", None)
    assert split_host("[::1]:80") == ("[::1]", 80)
    assert split_host("[::1]") == ("[::1]", None)
    assert split_host("a:b") is None and split_host(":80") is None and split_host("") is None


def test_rules_from_the_flags():
    assert rules("127.0.0.1") == {"check_host": True, "allowed": [], "key": None}
    assert rules("0.0.0.0") == {"check_host": False, "allowed": [], "key": None}
    assert rules("0.0.0.0", ["Box:8443", "dlm.lan"], "k") == {"check_host": True,
                                                             "allowed": [("box", 8443), ("dlm.lan", None)],
                                                             "key": b"k"}
    assert rules("127.0.0.1", ["*", "dlm.lan"]) == {"check_host": False, "allowed": [("dlm.lan", None)], "key": None}
    with pytest.raises(DlmError, match=r"^--allowed-hosts: 'a:b' is not a host name, name:port or \[IPv6\]:port$"):
        rules("127.0.0.1", ["ok", "a:b"])
    with pytest.raises(DlmError, match=r"^the API key \(--api-key or DLM_API_KEY\) is empty: give a key, or neither "
                                       r"to serve without one$"):
        rules("127.0.0.1", api_key=" ")


def test_the_host_check_answers_403_with_the_port_to_use():
    access = made()
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST:8000"):
        assert call(access, host=host)[0] == 0, host
    status, body, headers = call(access, host="evil.example:8000")
    assert (status, headers["connection"]) == (403, "close") and "www-authenticate" not in headers
    assert body == {"error": {"message": "Host 'evil.example:8000' is not a name this server answers to: use "
                                         "localhost, 127.0.0.1 or [::1] with port 8000 (dlm serve --allowed-hosts "
                                         "adds names)", "type": "invalid_request_error", "param": None,
                              "code": "host_not_allowed"}}
    for host in ("localhost:8001", "localhost", "127.0.0.2:8000", "a:b", "evil.example"):
        assert call(access, host=host)[0] == 403, host
    assert call(access, host="localhost", port=80)[0] == 0  # no port in Host means 80
    assert call(access, host="localhost:80", port=80)[0] == 0
    assert call(access, host=None)[0] == 0  # HTTP/1.0 without Host
    long = "x" * 100
    assert call(access, host=long)[1]["error"]["message"].startswith(f"Host '{'x' * 77}...' is not")
    assert call(access, host="z" * 81)[1]["error"]["message"].startswith(f"Host '{'z' * 77}...' is not")
    exact = "y" * 80
    assert call(access, host=exact)[1]["error"]["message"].startswith(f"Host '{exact}' is not")
    assert call(access, host="evil", kind="websocket")[0] == 0  # only HTTP requests are checked
    assert call(made("0.0.0.0"), host="anything.example")[0] == 0


def test_allowed_hosts_add_names_with_or_without_a_port():
    access = made(allowed_hosts=["dlm.lan", "box:8443"])
    for host, status in (("dlm.lan", 0), ("DLM.LAN:1234", 0), ("box:8443", 0), ("box:8444", 403), ("box", 403),
                         ("localhost:8000", 0), ("other", 403), ("dlm.lan.evil", 403)):
        assert call(access, host=host)[0] == status, host
    served = made("0.0.0.0", ["dlm.lan"])
    assert call(served, host="dlm.lan")[0] == 0 and call(served, host="other.lan")[0] == 403


def test_the_first_of_repeated_headers_counts():
    access = made(api_key="k1")
    first_bad = [("Host", "evil"), ("Authorization", "Bearer k1")]
    assert call(access, host="localhost:8000", headers=first_bad)[0] == 0
    assert call(access, host=None, headers=[("Host", "evil"), ("Host", "localhost:8000"),
                                            ("Authorization", "Bearer k1")])[0] == 403
    assert call(access, headers=[("Authorization", "Bearer k2"), ("Authorization", "Bearer k1")])[0] == 401


def test_the_api_key_guards_v1_only():
    access = made(api_key="sekret")
    for path in ("/v1", "/v1/models", "/v1/chat/completions"):
        status, body, headers = call(access, path=path)
        assert (status, body["error"]["code"], headers["www-authenticate"], headers["connection"]) == (
            401, "missing_api_key", "Bearer", "close"), path
        assert body["error"]["message"] == ("this server needs an API key: send Authorization: Bearer KEY (the key "
                                            "given to dlm serve --api-key or DLM_API_KEY)")
        assert call(access, path=path, headers=[("Authorization", "Bearer sekret")])[0] == 0
    for path in ("/", "/health", "/v1x", "/v2/models", "/static/app.js"):
        assert call(access, path=path)[0] == 0, path
    for value, code in (("Basic sekret", "missing_api_key"), ("Bearer ", "missing_api_key"),
                        ("Bearer   ", "missing_api_key"), ("sekret", "missing_api_key"),
                        ("Bearer sekret2", "invalid_api_key"), ("Bearer sekre", "invalid_api_key")):
        status, body, _ = call(access, headers=[("Authorization", value)])
        assert (status, body["error"]["code"]) == (401, code), value
    message = call(access, headers=[("Authorization", "Bearer x")])[1]["error"]["message"]
    assert message == ("the API key is wrong (Authorization: Bearer KEY must send the key given to dlm serve "
                       "--api-key or DLM_API_KEY)")
    for value in ("bearer sekret", "BEARER sekret", "Bearer  sekret ", "Bearer sekret "):
        assert call(access, headers=[("Authorization", value)])[0] == 0, value
    assert call(made(), path="/v1/models")[0] == 0  # no key: open
