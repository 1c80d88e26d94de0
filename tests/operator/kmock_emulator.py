"""A kmock KubernetesEmulator that behaves enough like a kube-apiserver for kopf and `kubernetes` clients.

kmock 0.8 keeps objects and streams watch events, but a real API server also: stamps uid,
resourceVersion, creationTimestamp and generation; names objects from generateName; resumes watches
from ?resourceVersion instead of replaying everything; filters by label and field selectors; ends
watches after ?timeoutSeconds; answers a failed JSON-patch with 422; skips no-op patches; keeps
status and spec apart when a resource has a status subresource; serves a CRD's resource as soon as
the CRD is created, with its schema's defaults and validation; and puts `kind` on lists.
Still missing (no controllers in this emulator): garbage collection, Deployment/Pod status, admission,
strategic merge (a strategic-merge patch is applied as a JSON merge patch), PUT, dry runs,
listing namespaces through /api/v1/namespaces (kmock's URL parser cannot).
"""

import asyncio
import copy
import datetime
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import jsonschema
import kmock
from kmock._internal import apps, dicts, enums, rendering

CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}
KEEP_REQUESTS = 10

# (resource, kind, namespaced, subresources): what a fresh cluster serves before any CRD.
BUILTINS = [
    ("v1/namespaces", "Namespace", False, {"status"}),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/services", "Service", True, {"status"}),
    ("v1/endpoints", "Endpoints", True, set()),
    ("v1/serviceaccounts", "ServiceAccount", True, set()),
    ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/secrets", "Secret", True, set()),
    ("v1/events", "Event", True, set()),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("discovery.k8s.io/v1/endpointslices", "EndpointSlice", True, set()),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, set()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, set()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, {"status"}),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, {"status"}),
]

_REQUIREMENT = re.compile(r"\s*(!?)([^\s=!,()]+)\s*(?:(==|=|!=)\s*([^\s,()]*)|(in|notin)\s*\(([^)]*)\))?\s*")


def parse_selector(text: str) -> list[tuple[str, str, set[str]]]:
    """Label (or field) selector syntax into (key, operator, values): =, !=, in, notin, exists, !exists."""
    requirements: list[tuple[str, str, set[str]]] = []
    position = 0
    while position < len(text):
        match = _REQUIREMENT.match(text, position)
        if not match or match.end() == position:
            raise ValueError(f"bad selector: {text!r}")
        negated, key, operator, value, set_operator, values = match.groups()
        if operator:
            requirements.append((key, "!=" if operator == "!=" else "=", {value}))
        elif set_operator:
            requirements.append((key, set_operator, {item.strip() for item in values.split(",") if item.strip()}))
        else:
            requirements.append((key, "!exists" if negated else "exists", set()))
        position = match.end()
        if position < len(text) and text[position] == ",":
            position += 1
    return requirements


def matches(requirements: list[tuple[str, str, set[str]]], values: dict[str, str]) -> bool:
    for key, operator, wanted in requirements:
        present, value = key in values, values.get(key)
        if operator in ("=", "in") and value not in wanted:
            return False
        if operator in ("!=", "notin") and present and value in wanted:
            return False
        if (operator == "exists") != present and operator in ("exists", "!exists"):
            return False
    return True


def _field_values(obj: dict[str, Any], keys: list[str]) -> dict[str, str]:
    found = {}
    for key in keys:
        value: Any = obj
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            found[key] = str(value)
    return found


def apply_defaults(schema: dict[str, Any], value: Any) -> None:
    """Fill `default`s of an OpenAPI v3 schema into value, in place, as the API server does."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    apply_defaults(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


def _revision(obj: dict[str, Any]) -> int:
    return int(obj.get("metadata", {}).get("resourceVersion") or 0)


def _invalid(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=message)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """KubernetesEmulator with the API-server behaviour listed in the module docstring."""

    _revision_counter: int = attrs.field(default=0, init=False)
    _schemas: dict[Any, dict[str, Any]] = attrs.field(factory=dict, init=False)
    log: list[tuple[str, str]] = attrs.field(factory=list, init=False)  # (method, path?query) of each request
    _active: set[rendering.Request] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, kind, namespaced, subresources in BUILTINS:
            self.resources[name] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=VERBS, subresources=subresources
            )

    def _next_revision(self) -> str:
        self._revision_counter += 1
        return str(self._revision_counter)

    def _info(self, resource: Any) -> kmock.ResourceInfo:
        return self.resources[resource] if resource in self.resources else kmock.ResourceInfo()

    async def _handle(self, request: rendering.Request) -> Any:
        self.log.append((str(getattr(request.method, "value", request.method)), str(request.url.path_qs)))
        # kmock matches every request against its whole request history (quadratic: a test's
        # thousandth request took 50 ms). Keep only a short tail and the requests being served.
        self._active.add(request)
        older, tail = self._requests[:-KEEP_REQUESTS], self._requests[-KEEP_REQUESTS:]
        self._requests[:] = [old for old in older if old in self._active] + tail
        try:
            return await self._serve(request)
        finally:
            self._active.discard(request)

    async def _serve(self, request: rendering.Request) -> Any:
        if request.resource is not None and request.action == enums.action.UPDATE and request.name is not None:
            async with self._lock:
                await self._update(request)
            # Skip KubernetesEmulator's own patching (done above) but keep reactions and fallbacks.
            return await apps.RawHandler._handle(self, request)
        if request.resource is not None and request.action == enums.action.CREATE:
            self._prepare_create(request)
        response = await super()._handle(request)
        if request.resource == CRDS and request.action == enums.action.CREATE:
            self._register_crd(request.data)
        return response

    def _prepare_create(self, request: rendering.Request) -> None:
        data = request.data
        if not isinstance(data, dict):
            raise _invalid("the body must be an object")
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _invalid("metadata.name is required")
        if request.namespace:
            meta["namespace"] = request.namespace
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now, generation=1)
        if "status" in self._info(request.resource).subresources:
            data.pop("status", None)  # status is written through the subresource only
        self._admit(request.resource, data)
        meta["resourceVersion"] = self._next_revision()

    def _admit(self, resource: Any, obj: dict[str, Any]) -> None:
        schema = self._schemas.get(resource)
        if schema is not None:
            apply_defaults(schema, obj)
            try:
                jsonschema.validate({k: v for k, v in obj.items() if k != "metadata"}, schema)
            except jsonschema.ValidationError as e:
                raise _invalid(f"{'.'.join(map(str, e.absolute_path))}: {e.message}") from None

    async def _update(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        stored = self.objects[key]
        old = copy.deepcopy(stored.raw)
        patch = request.data
        wanted = patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
        if wanted and wanted != old["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        try:
            new = dict(dicts.patch_dict(copy.deepcopy(old), patch))
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, ValueError, TypeError) as e:
            raise _invalid(f"cannot apply the patch: {e}") from None
        if "status" in self._info(request.resource).subresources:
            # The status subresource writes status only, the main resource everything else.
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
            else:
                new = {key: value for key, value in new.items() if key != "status"}
                if "status" in old:
                    new["status"] = old["status"]
            new = {key: value for key, value in new.items() if value is not None}
        self._admit(request.resource, new)
        new["metadata"]["resourceVersion"] = old["metadata"].get("resourceVersion")
        if new == old:
            return  # a no-op patch changes nothing and wakes no watcher, as on a real API server
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        new["metadata"]["resourceVersion"] = self._next_revision()
        stored.history.append(new)
        await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            stored.delete()
            await self._buses[request.resource].put({"type": "DELETED", "object": new})

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                shortnames=names.get("shortNames", []),
                namespaced=spec["scope"] == "Namespaced",
                verbs=VERBS,
                subresources=set(version.get("subresources", {})),
            )
            self._schemas[resource] = version.get("schema", {}).get("openAPIV3Schema", {})

    def _selected(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        labels = request.params.get("labelSelector")
        if labels and not matches(parse_selector(labels), obj.get("metadata", {}).get("labels") or {}):
            return False
        fields = request.params.get("fieldSelector")
        if fields:
            requirements = parse_selector(fields)
            return matches(requirements, _field_values(obj, [key for key, _, _ in requirements]))
        return True

    def _list_kind(self, resource: Any) -> tuple[str, str]:
        api_version = resource.version if resource.group == "" else f"{resource.group}/{resource.version}"
        return api_version, f"{self._info(resource).kind or 'Object'}List"

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        listed = await super()._serve_list(request)
        api_version, kind = self._list_kind(request.resource)
        return {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"resourceVersion": str(self._revision_counter)},
            "items": [obj for obj in listed["items"] if self._selected(request, obj)],
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers now: an idle watch is still a watch
        since = int(request.params.get("resourceVersion") or 0)
        timeout = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        bus = self._buses[request.resource]
        mark = await bus.mark()  # before the snapshot, so that no change falls between the two
        try:
            async with self._lock:
                snapshot = [
                    obj.raw
                    for (resource, namespace, _), obj in self.objects.items()
                    if resource == request.resource
                    and not obj.deleted
                    and (request.namespace is None or namespace == request.namespace)
                ]
            seen = {}
            for obj in snapshot:
                seen[(obj["metadata"].get("namespace"), obj["metadata"]["name"])] = _revision(obj)
                if _revision(obj) > since and self._selected(request, obj):
                    yield {"type": "ADDED", "object": obj}
            async with asyncio.timeout(timeout):
                async for event in bus.stream(since=mark):
                    obj = event["object"]
                    meta = obj.get("metadata", {})
                    if request.namespace is not None and meta.get("namespace") != request.namespace:
                        continue
                    already = seen.get((meta.get("namespace"), meta.get("name")), 0)
                    if event["type"] != "DELETED" and _revision(obj) <= max(already, since):
                        continue
                    if self._selected(request, obj):
                        yield event
        except TimeoutError:
            return
        finally:
            await bus.unmark(mark)
