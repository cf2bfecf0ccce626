"""The dashboard as a WSGI app: waitress, the HTTP wire format, host checks, the CLI."""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request

import dash
import pytest

from attnres_probe import Probe
from attnres_probe.cli import build_parser
from attnres_probe.dashboards import create_app, create_server
from attnres_probe.dashboards.serving import load_entries, serve
from attnres_probe.dashboards.wire import update_payload

from dash_helpers import TEXT, make_model


@pytest.fixture
def waitress_url(app):
    """The app under waitress (4 threads) on a free loopback port, in a thread."""
    waitress = pytest.importorskip("waitress")
    server = waitress.create_server(app.server, host="127.0.0.1", port=0, threads=4)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.effective_port}"
    server.close()
    thread.join(timeout=5)


def fetch(url: str, body: dict | None = None, host: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if host:
        req.add_header("Host", host)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_waitress_serves_the_page_layout_and_a_token_callback(app, waitress_url):
    status, page = fetch(waitress_url + "/")
    assert status == 200 and b"_dash-config" in page
    status, layout = fetch(waitress_url + "/_dash-layout")
    assert status == 200 and app.explorer.initial.key.encode() in layout
    body = update_payload(app, "token-info.children", {"token.data": {"key": app.explorer.initial.key, "token": 2},
                                                        "kind.value": "weights", "expanded.value": []})
    status, resp = fetch(waitress_url + "/_dash-update-component", body)
    response = json.loads(resp)["response"]
    assert status == 200 and response["token-graph-1"]["figure"]["layout"]["title"]["text"].startswith("token 2 ")


def test_the_page_references_no_external_url(app):
    page = app.server.test_client().get("/").data.decode()
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page


def test_requests_for_another_host_are_refused(app):
    client = app.server.test_client()
    assert client.get("/", headers={"Host": "attacker.example:8050"}).status_code == 421
    assert client.get("/", headers={"Host": "127.0.0.1:8050"}).status_code == 200
    assert client.get("/", headers={"Host": "localhost"}).status_code == 200
    open_app = create_app(app.explorer.initial.traces, allowed_hosts=None)
    assert open_app.server.test_client().get("/", headers={"Host": "box.lan:8050"}).status_code == 200


def test_oversized_requests_are_refused(app):
    resp = app.server.test_client().post("/_dash-update-component", data=b"x" * (3 * 2**20), content_type="application/json")
    assert resp.status_code == 413


def test_callbacks_belong_to_their_app_not_to_dash_globals(models):
    before = len(dash._callback.GLOBAL_CALLBACK_LIST)
    a, b = create_app(models, text=TEXT), create_app({"full": Probe(models["full"])}, text="other")
    assert len(dash._callback.GLOBAL_CALLBACK_LIST) == before
    assert a.callback_map and b.callback_map and a.explorer is not b.explorer


def test_create_server_returns_the_flask_app(models):
    server = create_server({"block": models["block"]}, text=TEXT)
    assert server.test_client().get("/_dash-dependencies").status_code == 200


# -- CLI ----------------------------------------------------------------------------------------
def test_dash_command_binds_to_loopback_by_default():
    args = build_parser().parse_args(["dash"])
    assert (args.host, args.port, args.threads, args.models, args.traces) == ("127.0.0.1", 8050, 8, None, None)


def test_dash_loads_checkpoint_and_trace_folders(tmp_path, models):
    make_model("block").save(tmp_path / "my-block")
    Probe(models["full"], name="old-full").run(TEXT).save(tmp_path / "trace")
    entries = load_entries([str(tmp_path / "my-block")], [str(tmp_path / "trace")])
    assert list(entries) == ["my-block", "old-full"]
    app = create_app(entries)
    assert app.explorer.live and set(app.explorer.initial.traces) == {"my-block", "old-full"}


def test_dash_rejects_a_missing_folder(tmp_path):
    with pytest.raises(NotADirectoryError, match="--models"):
        load_entries([str(tmp_path / "missing")])


def test_a_busy_port_is_a_clear_error(app):
    pytest.importorskip("waitress")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(app, port=port)
