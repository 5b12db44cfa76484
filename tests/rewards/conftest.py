"""The reward-server tests' fixtures: no proxy between the client and the loopback server, and `start`."""

import threading

import pytest


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def start():
    """start(rewards, **serve_kwargs) -> running server (shut down after the test)."""
    from jagg_scale.rewards.server import serve

    servers = []

    def _start(rewards, **kw):
        srv = serve(rewards, **kw)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        srv.shutdown()
        srv.server_close()
