"""Who may use the gateway (peerd/gateway/guard.py): the real app in process, with no daemon behind
it, so a request the guard lets through ends in 503 `no_daemon` (or a 4xx for its body) and one it
stops ends in 403, 401 or 415 before any route runs.

The attacks are those of docs/gateway.md "Who may use it": a DNS-rebinding page (Host: evil.example,
then Origin == Host), another site's form post or text/plain JSON, and anyone on the network when
the gateway listens beyond loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from typer.testing import CliRunner

from peerd.gateway import create_app
from peerd.gateway.guard import Exposure, host_name, is_loopback_host

BASE = "http://127.0.0.1:8000"
KEY = "k3y-for-tests_0123456789"
GENERATE = {"inputs": "The capital of France is", "max_new_tokens": "4"}
CHAT = '{"model": "default", "messages": [{"role": "user", "content": "hi"}]}'


def client(tmp_path: Path, exposure: Exposure | None = None) -> TestClient:
    app = create_app(tmp_path / "no-daemon.sock", exposure=exposure)
    return TestClient(app, base_url=BASE, raise_server_exceptions=True)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[TestClient]:
    with client(tmp_path) as test_client:
        yield test_client


def reached_a_route(response: Any) -> bool:
    """The guard let it through: it got the answer a gateway without a daemon gives."""
    body = response.json()
    return response.status_code == 503 and body.get("error", body)["code"] == "no_daemon"


def ws_refusal(test_client: TestClient, headers: dict[str, str] | None = None, **kw: Any) -> str:
    """Why a v2 handshake was refused (AssertionError if it was accepted). The test client's
    sockets say Host: testserver unless told otherwise."""
    try:
        with test_client.websocket_connect(
            "/api/v2/generate", headers={"Host": "127.0.0.1:8000", **(headers or {})}, **kw
        ):
            pass
    except WebSocketDisconnect as refused:  # before the accept: uvicorn answers 403
        assert refused.code == 1008
        return str(refused.reason)
    raise AssertionError("the handshake was accepted")


def test_a_dns_rebinding_page_gets_403(gateway: TestClient) -> None:
    refused = gateway.get("/api/status", headers={"Host": "evil.example"})
    assert refused.status_code == 403 and refused.json()["code"] == "host_not_allowed"
    assert "--allowed-hosts" in refused.json()["traceback"]
    evil = {"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}
    assert gateway.post("/api/v1/generate", data=GENERATE, headers=evil).status_code == 403
    assert ws_refusal(gateway, headers=evil) == "host_not_allowed"
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST", "a.localhost"):
        assert reached_a_route(gateway.get("/api/status", headers={"Host": host})), host


def test_another_sites_form_post_gets_403(gateway: TestClient) -> None:
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "http://127.0.0.1:9999"},  # another local server's page
        {"Origin": "null"},  # a sandboxed frame or a data: URL
        {"Sec-Fetch-Site": "cross-site"},  # a browser that left Origin out
    ):
        refused = gateway.post("/api/v1/generate", data=GENERATE, headers=headers)
        assert refused.status_code == 403, headers
        assert refused.json()["code"] == "origin_not_allowed"
        assert ws_refusal(gateway, headers=headers) == "origin_not_allowed", headers
    # Its own page (same origin) and programs (no Origin) are served.
    own = {"Origin": BASE, "Sec-Fetch-Site": "same-origin"}
    assert reached_a_route(gateway.post("/api/v1/generate", data=GENERATE, headers=own))
    assert reached_a_route(gateway.post("/api/v1/generate", data=GENERATE))
    # A cross-origin GET is harmless (the browser hides the answer): not refused.
    assert reached_a_route(gateway.get("/api/status", headers={"Origin": "https://evil.example"}))


def test_json_only_as_application_json(gateway: TestClient) -> None:
    for kind in ("text/plain", None):
        headers = {"Content-Type": kind} if kind else {}
        refused = gateway.post("/v1/chat/completions", content=CHAT, headers=headers)
        assert refused.status_code == 415, kind
        assert refused.json()["error"]["code"] == "unsupported_media_type"
        assert "application/json" in refused.json()["error"]["message"]
        body = '{"inputs": "hi", "max_new_tokens": 4}'
        assert gateway.post("/api/v1/generate", content=body, headers=headers).status_code == 415
    as_json = {"Content-Type": "application/json; charset=utf-8"}
    assert reached_a_route(gateway.post("/v1/chat/completions", content=CHAT, headers=as_json))


def test_api_key_is_needed_for_the_apis_not_the_pages(tmp_path: Path) -> None:
    with client(tmp_path, Exposure(api_key=KEY)) as keyed:
        missing = keyed.get("/api/status")
        assert missing.status_code == 401 and missing.json()["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = keyed.post("/v1/chat/completions", content=CHAT, headers={"Authorization": "x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        bearer = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        assert reached_a_route(keyed.post("/v1/chat/completions", content=CHAT, headers=bearer))
        assert reached_a_route(keyed.get("/api/v1/swarm", headers=bearer))
        for page in ("/", "/swarm", "/static/key.js"):
            assert keyed.get(page).status_code == 200, page
        assert ws_refusal(keyed) == "invalid_api_key"
        wrong_key = ["peerd", "peerd.key.wrong-key-0123456789"]
        assert ws_refusal(keyed, subprotocols=wrong_key) == "invalid_api_key"
        # The page's way: the key as a subprotocol, and "peerd" selected back.
        with keyed.websocket_connect(
            "/api/v2/generate",
            headers={"Host": "127.0.0.1:8000", "Origin": BASE},
            subprotocols=["peerd", f"peerd.key.{KEY}"],
        ) as ws:
            assert ws.accepted_subprotocol == "peerd"
            ws.send_json({"type": "open_inference_session", "max_length": 64})
            assert ws.receive_json()["code"] == "no_daemon"


def test_exposure_beyond_loopback_needs_a_key_and_names_its_hosts() -> None:
    with pytest.raises(ValueError, match="API key"):
        Exposure.for_bind("0.0.0.0")
    with pytest.raises(ValueError, match="16 to 256"):
        Exposure.for_bind("127.0.0.1", api_key="short")
    with pytest.raises(ValueError, match="scheme://host"):
        Exposure.for_bind("127.0.0.1", allowed_origins=["evil.example"])
    public = Exposure.for_bind("0.0.0.0", api_key=KEY, allowed_hosts=["Chat.Example.org:443"])
    assert public.host_allowed("192.168.1.5:8000") and public.host_allowed("[fe80::1]:80")
    assert public.host_allowed("chat.example.org") and not public.host_allowed("evil.example")
    local = Exposure.for_bind("127.0.0.1")
    assert not local.host_allowed("192.168.1.5:8000") and local.host_allowed("127.0.0.2")
    assert Exposure.for_bind("::1").public is False
    assert is_loopback_host("[::1]") and not is_loopback_host("localhost.evil.example")
    assert host_name("[::1]:8000") == "::1" and host_name("Example.ORG.:80") == "example.org"


def test_allowed_origins_may_post_and_get_cors_answers(tmp_path: Path) -> None:
    exposure = Exposure.for_bind("127.0.0.1", allowed_origins=["https://app.example/"])
    with client(tmp_path, exposure) as test_client:
        origin = {"Origin": "https://app.example"}
        answer = test_client.post("/api/v1/generate", data=GENERATE, headers=origin)
        assert reached_a_route(answer)
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        preflight = test_client.options(
            "/v1/chat/completions",
            headers={**origin, "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        other = {"Origin": "https://evil.example"}
        assert test_client.post("/api/v1/generate", data=GENERATE, headers=other).status_code == 403


def test_cli_refuses_to_listen_publicly_without_a_key() -> None:
    from cli import app

    result = CliRunner().invoke(app, ["gateway", "--host", "0.0.0.0"], env={})
    assert result.exit_code == 2
    assert "API key" in result.output and "PEERD_GATEWAY_API_KEY" in result.output


def test_docs_give_the_slot_count_the_code_uses() -> None:
    """docs/gateway.md once said 16 slots and 16 sessions per peer while the code used 64."""
    import re

    from peerd.gateway.link import SESSION_SLOTS
    from wire.peer_protocol import DEFAULT_SESSIONS_PER_PEER

    docs = (Path(__file__).resolve().parent.parent / "docs" / "gateway.md").read_text()
    table = re.search(r"\| generations and v2 sessions at once \| (\d+) \(`SESSION_SLOTS`\)", docs)
    assert table is not None and int(table.group(1)) == SESSION_SLOTS
    per_peer = re.search(r"a server takes at most (\d+) sessions\s+from one peer", docs)
    assert per_peer is not None and int(per_peer.group(1)) == DEFAULT_SESSIONS_PER_PEER
    counts = {int(n) for n in re.findall(r"(\d+) (?:generation )?slots", docs)}
    assert counts <= {SESSION_SLOTS, 16}, counts  # 16: the measurement made with 16 slots
    assert f"all {SESSION_SLOTS} slots" in docs and f"one of the {SESSION_SLOTS} slots" in docs
