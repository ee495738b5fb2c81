"""ASGI middleware of the local vLLM servers (`--middleware ops.serving.vllm_auth.require_api_key`):
every request but /health must carry `Authorization: Bearer <key>`, the key the server was
started with (environment PERPETUA_VLLM_API_KEY). Without a key configured, everything but
/health is refused. See ops/serving/api_key.py for why vLLM's --api-key alone is not enough."""

from __future__ import annotations

import hmac
import os

KEY_ENV = "PERPETUA_VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


async def require_api_key(request, call_next):
    if request.url.path not in OPEN_PATHS:
        key = os.environ.get(KEY_ENV, "")
        got = request.headers.get("authorization", "")
        if not key or not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            from starlette.responses import JSONResponse

            return JSONResponse({"error": {"message": "unauthorized: send this server's API key "
                                                      "(PERPETUA_HOME/services/vllm-api-key) as a Bearer token",
                                           "code": 401}}, status_code=401)
    return await call_next(request)
