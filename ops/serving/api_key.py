"""The secret that guards the local vLLM servers of one PERPETUA_HOME.

vLLM's own `--api-key` (VLLM_API_KEY) guards only /v1, /v2, /inference and /cohere, not the
development endpoints (/collective_rpc, /update_weight_version, /pause, ...) that refit a server
and set the version it reports. So each server also runs `ops.serving.vllm_auth`, which asks the
same key of every path but /health. The key is generated once per home into
`services/vllm-api-key` (mode 0600, refused if anyone else can read it); the environment
variable PERPETUA_VLLM_API_KEY overrides it (a server not of this home). Every client sends it as
`Authorization: Bearer <key>`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ops.common.atomic import owner_only_secret

KEY_ENV = "PERPETUA_VLLM_API_KEY"


class ApiKeyError(RuntimeError):
    pass


def key_file(root: Path) -> Path:
    return Path(root) / "services" / "vllm-api-key"


def api_key(root: Path | None = None, *, create: bool = True) -> str | None:
    """The key of the home at `root` (default: PERPETUA_HOME), created on first use."""
    if env := os.environ.get(KEY_ENV, "").strip():
        return env
    if root is None:
        from ops.common.paths import home

        root = home().root
    path = key_file(root)
    if not path.exists() and not create:
        return None
    try:
        return owner_only_secret(path, 32)
    except PermissionError as e:
        raise ApiKeyError(str(e)) from None
    except ValueError as e:
        raise ApiKeyError(f"{e}; delete it to generate a new key") from None


def auth_headers(root: Path | None = None) -> dict[str, str]:
    """The header a client sends; empty when this home has no key yet (no server was started)."""
    key = api_key(root, create=False)
    return {"Authorization": f"Bearer {key}"} if key else {}
