"""The local vLLM servers' key: one per PERPETUA_HOME, private to its owner, asked of every
endpoint but /health by the middleware the servers run (vLLM's own --api-key leaves the
development endpoints open). The same check against a real vLLM server is in
tests/test_rollout_server.py."""

from __future__ import annotations

import os

import pytest


def _app():
    from fastapi import FastAPI

    from ops.serving.vllm_auth import require_api_key

    app = FastAPI()
    app.middleware("http")(require_api_key)
    for path in ("/health", "/collective_rpc", "/update_weight_version", "/v1/completions"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    return app


def test_every_endpoint_but_health_needs_the_key(monkeypatch):
    from starlette.testclient import TestClient

    monkeypatch.setenv("PERPETUA_VLLM_API_KEY", "s3cret")
    client = TestClient(_app())
    assert client.get("/health").status_code == 200
    for path in ("/collective_rpc", "/update_weight_version", "/v1/completions"):
        assert client.post(path, json={"new_version": "9"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    monkeypatch.delenv("PERPETUA_VLLM_API_KEY")
    assert client.post("/collective_rpc", headers={"Authorization": "Bearer "}).status_code == 401, "no key: all refused"


def test_the_home_key_is_created_once_private_and_checked(tmp_path, monkeypatch):
    from ops.serving.api_key import ApiKeyError, api_key, auth_headers, key_file

    monkeypatch.delenv("PERPETUA_VLLM_API_KEY", raising=False)
    assert api_key(tmp_path, create=False) is None and auth_headers(tmp_path) == {}
    key = api_key(tmp_path)
    assert len(key) >= 32 and api_key(tmp_path) == key
    assert (key_file(tmp_path).stat().st_mode & 0o777) == 0o600
    assert auth_headers(tmp_path) == {"Authorization": f"Bearer {key}"}
    os.chmod(key_file(tmp_path), 0o644)
    with pytest.raises(ApiKeyError, match="chmod 600"):
        api_key(tmp_path)
    monkeypatch.setenv("PERPETUA_VLLM_API_KEY", "from-env")
    assert api_key(tmp_path) == "from-env"
