"""Offline validation of Kubernetes objects against the `kubernetes` Python client's models.

The client's own deserializer ignores keys it does not know and coerces scalars, so a typo
(`imagePullPolicey`) or a list where a map belongs would pass it silently. `check_object` walks the
object alongside the model's `openapi_types` / `attribute_map` and refuses unknown fields and
wrongly typed values; then the client's deserializer builds the model, which enforces the fields
the API marks required (client-side validation). Top-level metadata must name the object.
"""

from __future__ import annotations

import re

import kubernetes.client as k8s

_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool}
# Type strings of the client's models: 'List[V1Container]', 'Dict[str, str]' (older clients:
# 'list[V1Container]', 'dict(str, str)').
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:Dict\[([^,]+), (.+)\]|dict\(([^,]+), (.+)\))$")


class ManifestError(ValueError):
    """An object Kubernetes would reject or misread: one line naming the object and the field."""


def model_name(obj: dict) -> str:
    """'apps/v1' + 'Deployment' -> 'V1Deployment' (the client's class name)."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        raise ManifestError("object without apiVersion/kind")
    return api_version.split("/")[-1].capitalize() + kind


def _check(value, type_name: str, path: str) -> None:
    if value is None:
        return
    if m := _LIST.match(type_name):
        if not isinstance(value, list):
            raise ManifestError(f"{path}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, m.group(1), f"{path}[{i}]")
        return
    if m := _DICT.match(type_name):
        if not isinstance(value, dict):
            raise ManifestError(f"{path}: expected a mapping, got {type(value).__name__}")
        for k, v in value.items():
            _check(v, m.group(2) or m.group(4), f"{path}.{k}")
        return
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and not (type_name != "bool" and isinstance(value, bool))
        if not ok:
            raise ManifestError(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    if type_name in ("object", "datetime", "date"):
        return  # IntOrString, Quantity-like free values and timestamps
    cls = getattr(k8s, type_name, None)
    if cls is None:
        raise ManifestError(f"{path}: the kubernetes client has no model {type_name}")
    if not isinstance(value, dict):
        raise ManifestError(f"{path}: expected a {type_name} mapping, got {type(value).__name__}")
    by_key = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    for key, item in value.items():
        if key not in by_key:
            known = ", ".join(sorted(by_key))
            raise ManifestError(f"{path}.{key}: unknown field of {type_name} (known: {known})")
        _check(item, cls.openapi_types[by_key[key]], f"{path}.{key}")


def check_fragment(value, type_name: str, where: str) -> None:
    """Validate a fragment (a list of V1Volume, a V1ResourceRequirements, ...) embedded elsewhere,
    e.g. in Helm values."""
    _check(value, type_name, where)
    _deserialize(value, type_name, where)


def _deserialize(value, type_name: str, where: str):
    try:
        return k8s.ApiClient()._ApiClient__deserialize(value, type_name)
    except (ValueError, TypeError, AttributeError) as e:
        raise ManifestError(f"{where}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    """The first problem of a model error (pydantic-based clients list several, over lines)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        missing = first.get("input") is None and first.get("type", "").endswith("_type")
        what = "is required" if missing else first.get("msg", "invalid")
        return f"{getattr(e, 'title', '')} {loc}: {what}".strip()
    return " ".join(str(e).split())


def check_object(obj: dict, source: str = "") -> str:
    """Validate one object; returns 'Kind/name'. Raises ManifestError with a one-line reason."""
    if not isinstance(obj, dict):
        raise ManifestError(f"{source}: a manifest document must be a mapping")
    name = model_name(obj)
    meta = obj.get("metadata") or {}
    ident = f"{obj['kind']}/{meta.get('name', '?')}"
    where = f"{source}: {ident}" if source else ident
    if not meta.get("name"):
        raise ManifestError(f"{where}: metadata.name is required")
    if getattr(k8s, name, None) is None:
        raise ManifestError(f"{where}: unknown kind {obj['apiVersion']}/{obj['kind']}")
    try:
        _check(obj, name, where)
    except ManifestError as e:
        raise ManifestError(str(e)) from None
    _deserialize(obj, name, where)
    _check_workload(obj, where)
    return ident


def _check_workload(obj: dict, where: str) -> None:
    """What the API server checks beyond the schema for the kinds rendered here."""
    kind, spec = obj["kind"], obj.get("spec") or {}
    if kind in ("Deployment", "Job"):
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = (spec.get("selector") or {}).get("matchLabels")
        if kind == "Deployment" and not selector:
            raise ManifestError(f"{where}: spec.selector.matchLabels is required")
        if selector and any(labels.get(k) != v for k, v in selector.items()):
            raise ManifestError(f"{where}: spec.selector does not match the pod template's labels")
        pod = template.get("spec") or {}
        if not pod.get("containers"):
            raise ManifestError(f"{where}: the pod template has no containers")
        if kind == "Job" and pod.get("restartPolicy") not in ("Never", "OnFailure"):
            raise ManifestError(f"{where}: a Job's restartPolicy must be Never or OnFailure")
        mounts = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts") or []}
        volumes = {v["name"] for v in pod.get("volumes") or []}
        if mounts - volumes:
            raise ManifestError(f"{where}: volumeMounts name undefined volumes {sorted(mounts - volumes)}")
    if kind == "Service" and not spec.get("ports"):
        raise ManifestError(f"{where}: a Service needs ports")


def check_selectors(objects: list[dict]) -> None:
    """Every Service selects the pods of some rendered workload."""
    pods = [((o.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
            for o in objects if o["kind"] in ("Deployment", "Job")]
    for o in objects:
        if o["kind"] != "Service":
            continue
        sel = (o.get("spec") or {}).get("selector") or {}
        if not any(all(p.get(k) == v for k, v in sel.items()) for p in pods):
            raise ManifestError(f"Service/{o['metadata']['name']}: its selector {sel} matches no rendered pod template")
