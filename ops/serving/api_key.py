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
import secrets
import stat
from pathlib import Path

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
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another process created it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ApiKeyError(f"{path} must be a regular file of uid {os.geteuid()} readable by its owner only (chmod 600)")
    key = path.read_text().strip()
    if not key:
        raise ApiKeyError(f"{path} is empty; delete it to generate a new key")
    return key


def auth_headers(root: Path | None = None) -> dict[str, str]:
    """The header a client sends; empty when this home has no key yet (no server was started)."""
    key = api_key(root, create=False)
    return {"Authorization": f"Bearer {key}"} if key else {}
