"""Plugins from installed packages: the entry points of one group, loaded once.

The verifier and environment registries both let a package extend Perpetua without touching it
(`perpetua.verifiers`, `perpetua.environments`). Loading is the same for both: each entry point
is imported once per process, and one that fails to import is logged and skipped, because a
broken third-party plugin must not take the pipeline down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger("perpetua.plugins")
_loaded_groups: set[str] = set()


def load_entry_points(group: str, register: Callable[[str, Any], None]) -> list[str]:
    """Import every entry point of `group` (the first call only) and hand each loaded object to
    `register(name, obj)`; returns the names loaded by this call."""
    if group in _loaded_groups:
        return []
    _loaded_groups.add(group)
    loaded = []
    for ep in entry_points(group=group):
        try:
            register(ep.name, ep.load())
        except Exception as e:  # noqa: BLE001 - a third-party plugin must not take the pipeline down
            log.error("%s entry point %s (%s) failed to load: %s", group, ep.name, ep.value, e)
            continue
        loaded.append(ep.name)
    return loaded
