"""Pod templates of the router and the engine pools of one PDService (pure functions of the spec).

Owns what runs in the pods: the `pdserve router|prefill|decode` command lines (flags: docs/contracts.md),
environment, ports, probes, resources, the model, KV-keys, /dev/shm and KV-tier volumes (a pool's kvCache), the
engine pods' tensor-parallel annotation and the security context.
"""

import math
from typing import Any

from pdserve.api.auth import API_KEY_ENV
from pdserve.api.keys import ENGINE_FILES, ROUTER_FILES
from pdserve.operator.names import (
    EPP,
    EPP_GRPC_PORT,
    KV_DISK_DIR,
    KV_KEYS,
    KV_KEYS_DIR,
    KV_SHARED_DIR,
    KV_SIDE_CHANNEL_PORT,
    MODEL_DIR,
    PORTS,
    ROUTER,
    TENSOR_PARALLEL_ANNOTATION,
    kv_keys_name,
    labels,
    object_name,
)
from pdserve.operator.spec import EPP_SPEC, disk_tier_bytes, duration_seconds, quantity_bytes

# The image's non-root user (its HOME is writable: Triton and CPU kernel caches); /tmp is an
# emptyDir so scratch files stay off the container's writable layer.
USER_ID = 1000
SCRATCH_DIR = "/tmp"
TENANTS_DIR = "/etc/pdserve/tenants"  # the router's tenant table (spec.router.tenantsSecret)

# Tensor-parallel ranks exchange tensors through /dev/shm (shared-memory files, gloo, NCCL), which
# container runtimes cap at 64 MiB: engine pods of more than one rank mount a memory-backed emptyDir
# there, of this many GiB per rank unless the pool's shmSize says otherwise.
SHM_DIR = "/dev/shm"
SHM_GIB_PER_RANK = 1

# The volumes of a pool's kvCache.disk (an emptyDir) and kvCache.shared (the user's ReadWriteMany claim).
KV_DISK_VOLUME = "kv-disk"
KV_SHARED_VOLUME = "kv-shared"

# Model loading can take many minutes (large weights over network storage); the startup probe
# holds liveness off for up to 30 minutes before the pod counts as failed.
ENGINE_STARTUP_FAILURES = 180
ROUTER_STARTUP_FAILURES = 30

# Runs in the init container of `source: huggingface`; arguments: repo, revision, target folder.
# It needs network access to the Hugging Face Hub (or a mirror through HF_ENDPOINT) from the cluster.
HF_DOWNLOAD = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3])"
)


def number(value: float) -> str:
    """A flag value for a number: 30 not 30.0, 2.5 stays 2.5."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _model_dir(model: dict[str, Any]) -> str:
    return f"{MODEL_DIR}/{model['path']}".rstrip("/")


def _router_reads_model(model: dict[str, Any]) -> bool:
    """The router mounts the model (for its tokenizer: prefix-aware routing) unless it is downloaded
    per pod (huggingface): then it routes by load only."""
    return model["source"] != "huggingface"


def engine_command(service: str, role: str, spec: dict[str, Any]) -> list[str]:
    model, kv = spec["model"], spec["kvTransfer"]
    model_dir = _model_dir(model)
    ranks = spec[role]["tensorParallelSize"]
    return [
        "pdserve",
        role,
        "--host",
        "0.0.0.0",
        "--port",
        str(PORTS[role]),
        "--model",
        model_dir,
        "--served-model-name",
        model.get("servedModelName") or service,
        "--kv-transfer",
        kv["backend"],
        "--kv-side-channel-port",
        str(KV_SIDE_CHANNEL_PORT),
        "--kv-lease-seconds",
        number(kv["leaseSeconds"]),
        "--kv-transfer-timeout",
        number(kv["transferTimeoutSeconds"]),
        "--kv-load-failure",
        kv["loadFailure"],
        "--kv-keys",
        KV_KEYS_DIR,
        *(["--drain-timeout", str(DECODE_DRAIN_S)] if role == "decode" else []),
        # The router clamps each tenant's priority; the engines honour it (a pool's engineArgs may say fcfs).
        "--scheduling-policy",
        "priority",
        *(["--tensor-parallel-size", str(ranks)] if ranks > 1 else []),
        *_kv_tier_flags(spec[role].get("kvCache") or {}),
        *spec[role].get("engineArgs", []),
    ]


def _kv_tier_flags(cache: dict[str, Any]) -> list[str]:
    """The engine's --kv-tier-* flags for a pool's kvCache (none for an empty or absent one)."""
    flags = []
    if "hostMemory" in cache:
        flags += ["--kv-tier-host-bytes", str(quantity_bytes(cache["hostMemory"]))]
    if "disk" in cache:
        flags += ["--kv-tier-disk", KV_DISK_DIR, "--kv-tier-disk-bytes", str(disk_tier_bytes(cache["disk"]["size"]))]
    shared = cache.get("shared")
    if shared is not None:
        flags += ["--kv-tier-shared", KV_SHARED_DIR]
        if "size" in shared:
            flags += ["--kv-tier-shared-bytes", str(quantity_bytes(shared["size"]))]
        if shared["readOnly"]:
            flags.append("--kv-tier-shared-read-only")
    if "maxAge" in cache:
        flags += ["--kv-tier-max-age", number(duration_seconds(cache["maxAge"]))]
    return flags


def _kv_tier_volumes(cache: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, the engine container's mounts of them) for a pool's kvCache.disk and kvCache.shared.

    A false readOnly is left out rather than written: the API server drops it, and the operator would
    otherwise see a difference to patch on every pass."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if "disk" in cache:
        # On the node's ephemeral storage: kept across restarts of the engine container, gone with the pod.
        volumes.append({"name": KV_DISK_VOLUME, "emptyDir": {"sizeLimit": cache["disk"]["size"]}})
        mounts.append({"name": KV_DISK_VOLUME, "mountPath": KV_DISK_DIR})
    shared = cache.get("shared")
    if shared is not None:
        read_only = {"readOnly": True} if shared["readOnly"] else {}
        claim = {"claimName": shared["claimName"], **read_only}
        volumes.append({"name": KV_SHARED_VOLUME, "persistentVolumeClaim": claim})
        mounts.append({"name": KV_SHARED_VOLUME, "mountPath": KV_SHARED_DIR, **read_only})
    return volumes, mounts


def router_command(
    service: str, namespace: str, spec: dict[str, Any], command: str = ROUTER, inference_pool: bool = False
) -> list[str]:
    """The router's command line, or (``command`` EPP) the endpoint picker's: the same pod choice, discovery, keys
    and tenants; the picker also serves gRPC (ext_proc) on its own port and, with ``inference_pool``, takes its
    decode pods from the InferencePool of the same name (its selector)."""
    part = spec[EPP_SPEC] if command == EPP else spec[ROUTER]
    return [
        "pdserve",
        command,
        "--host",
        "0.0.0.0",
        "--port",
        str(PORTS[command]),
        *(["--grpc-port", str(EPP_GRPC_PORT)] if command == EPP else []),
        "--discovery",
        "kubernetes",
        "--namespace",
        namespace,
        "--selector",
        f"app.kubernetes.io/instance={service}",
        *(["--inference-pool", service] if inference_pool and command == EPP else []),
        "--kv-keys",
        KV_KEYS_DIR,
        # The tenants' per-minute limits are the deployment's: each replica applies its share.
        "--router-replicas",
        str(part["replicas"]),
        *(["--tokenizer", _model_dir(spec["model"])] if _router_reads_model(spec["model"]) else []),
        *(["--tenants", _tenants_file(spec[ROUTER]["tenantsSecret"])] if spec[ROUTER].get("tenantsSecret") else []),
        *part.get("args", []),
    ]


def _tenants_file(secret: dict[str, Any]) -> str:
    return f"{TENANTS_DIR}/{secret['key']}"


def _field_env(name: str, field: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}


def _probes(startup_failures: int) -> dict[str, Any]:
    check = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "startupProbe": {**check, "periodSeconds": 10, "failureThreshold": startup_failures},
        "readinessProbe": {**check, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _engine_resources(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    resources = dict(spec[role].get("resources") or {})
    limits = dict(resources.get("limits") or {})
    if spec[role]["gpus"] > 0:
        limits["nvidia.com/gpu"] = str(spec[role]["gpus"])
    if spec["kvTransfer"].get("rdmaResource"):
        limits[spec["kvTransfer"]["rdmaResource"]] = "1"
    if limits:
        resources["limits"] = limits
    return resources


def _model_volume(model: dict[str, Any]) -> dict[str, Any]:
    if model["source"] == "pvc":
        return {"name": "model", "persistentVolumeClaim": {"claimName": model["claimName"], "readOnly": True}}
    if model["source"] == "hostPath":
        return {"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}
    return {"name": "model", "emptyDir": {}}


def shm_size(pool: dict[str, Any]) -> str | None:
    """The size of an engine pod's /dev/shm volume: the pool's shmSize, else 1Gi per rank when it has
    more than one; None: no volume (the runtime's 64 MiB is enough for one rank)."""
    if pool.get("shmSize"):
        return str(pool["shmSize"])
    size: int = pool["tensorParallelSize"]
    return f"{size * SHM_GIB_PER_RANK}Gi" if size > 1 else None


def _kv_keys_volume(service: str, spec: dict[str, Any], files: tuple[str, ...]) -> dict[str, Any]:
    """The items ``files`` of the PDService's keys: the user's Secret named in spec.kvTransfer.secretName, else
    the operator's. A router gets the router's files, an engine the engines' (no engine pod holds the key that
    signs as the router). Mode 0400, which the kubelet makes root:fsGroup 0440: readable by the pod's user only.
    The kubelet updates the files in place when the Secret changes (no subPath): a key rollover needs no restart."""
    secret = {
        "secretName": spec["kvTransfer"].get("secretName") or kv_keys_name(service),
        "defaultMode": 0o400,
        "items": [{"key": name, "path": name} for name in files],
    }
    return {"name": KV_KEYS, "secret": secret}


def _api_key_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """PDSERVE_API_KEY from the user's Secret (spec.apiKeySecret): the router checks clients' keys and
    forwards them on its legs, which the engines check too. None configured: no variable."""
    secret = spec.get("apiKeySecret")
    if not secret:
        return []
    ref = {"name": secret["name"], "key": secret["key"]}
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}]


def _kv_keys_mount() -> dict[str, Any]:
    return {"name": KV_KEYS, "mountPath": KV_KEYS_DIR, "readOnly": True}


def _model_download(spec: dict[str, Any], security: dict[str, Any]) -> dict[str, Any]:
    model = spec["model"]
    return {
        "name": "model-download",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["python", "-c", HF_DOWNLOAD, model["repo"], model["revision"], MODEL_DIR],
        "env": [{"name": "HF_HOME", "value": f"{SCRATCH_DIR}/huggingface"}],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}, {"name": "scratch", "mountPath": SCRATCH_DIR}],
        "securityContext": security,
    }


def _pod_security() -> dict[str, Any]:
    # Meets the "restricted" Pod Security Standard (but for hostPath model volumes).
    return {
        "runAsNonRoot": True,
        "runAsUser": USER_ID,
        "runAsGroup": USER_ID,
        # Secret volumes belong to root: without fsGroup uid 1000 could not read the 0400 keys.
        # (The model volume is mounted read-only, so the kubelet never re-owns the model files.)
        "fsGroup": USER_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


# A stopping decode pod hands the streams the router relays back to it after --drain-handoff (5 s); what still
# runs at its drain timeout (whole answers) is cut, and the router sends those again to another pod.
DECODE_DRAIN_S = 30


def _grace_period(role: str, kv: dict[str, Any]) -> int:
    """Seconds from SIGTERM to SIGKILL: a prefill pod keeps serving the blocks it holds for decode peers until
    their lease ends; a decode pod drains for ``DECODE_DRAIN_S``. Both with room to exit."""
    if role == "decode":
        return DECODE_DRAIN_S + 5
    return math.ceil(kv["leaseSeconds"]) + 30


def engine_pod(service: str, role: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a prefill or decode engine."""
    kv = spec["kvTransfer"]
    container = {
        "name": role,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": engine_command(service, role, spec),
        "env": [
            # The engines advertise this address to decode peers as remote_host.
            _field_env("PDSERVE_KV_HOST", "status.podIP"),
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            # The UCX transports NIXL may use between pods. NIXL serves only where they keep a peer inside the
            # registration (RDMA, with a device present); otherwise the checked TCP transport does
            # (pdserve/kvtransfer/nixl_policy.py).
            {"name": "UCX_TLS", "value": kv["ucxTransports"]},
            # Without it torch's OpenMP threads spin-wait without end and starve the API process (pdserve then
            # bounds the spin itself: OPENMP_ENV in pdserve/__init__.py).
            {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"},
            *_api_key_env(spec),
        ],
        "ports": [
            {"name": "http", "containerPort": PORTS[role], "protocol": "TCP"},
            {"name": "kv-side", "containerPort": KV_SIDE_CHANNEL_PORT, "protocol": "TCP"},
        ],
        "resources": _engine_resources(role, spec),
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
            _kv_keys_mount(),
        ],
        "securityContext": _container_security(),
        **_probes(ENGINE_STARTUP_FAILURES),
    }
    volumes = [
        _model_volume(spec["model"]),
        {"name": "scratch", "emptyDir": {}},
        _kv_keys_volume(service, spec, ENGINE_FILES),
    ]
    shm = shm_size(spec[role])
    if shm is not None:
        # Memory-backed: the kubelet sizes the tmpfs to sizeLimit, and what it holds counts against
        # the container's memory limit.
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        container["volumeMounts"].append({"name": "shm", "mountPath": SHM_DIR})
    tier_volumes, tier_mounts = _kv_tier_volumes(spec[role].get("kvCache") or {})
    volumes += tier_volumes
    container["volumeMounts"] += tier_mounts
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "initContainers": [_model_download(spec, _container_security())]
        if spec["model"]["source"] == "huggingface"
        else None,
        "volumes": volumes,
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": _grace_period(role, kv),
        # None: a merge patch removes a placement rule the user took out of the spec.
        "nodeSelector": spec[role].get("nodeSelector") or None,
        "tolerations": spec[role].get("tolerations") or None,
        "affinity": spec[role].get("affinity") or None,
        "topologySpreadConstraints": spec[role].get("topologySpreadConstraints") or None,
    }
    # An annotation, not a label: the Deployment's labels equal its pods', and nothing selects by it.
    # Written at size 1 too, so that a pool going back to 1 never keeps a stale value (merge patches
    # leave keys they do not name).
    annotations = {TENSOR_PARALLEL_ANNOTATION: str(spec[role]["tensorParallelSize"])}
    return {"metadata": {"labels": labels(service, role), "annotations": annotations}, "spec": pod_spec}


def router_pod(
    service: str, namespace: str, spec: dict[str, Any], command: str = ROUTER, inference_pool: bool = False
) -> dict[str, Any]:
    """The pod template of the router (discovers the engines through the Kubernetes API), or (``command`` EPP) of
    the endpoint picker, which runs as the router's principal: its ServiceAccount, its keys, its tenants."""
    part = spec[EPP_SPEC] if command == EPP else spec[ROUTER]
    ports = [{"name": "http", "containerPort": PORTS[command], "protocol": "TCP"}]
    if command == EPP:
        ports.append({"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"})
    container = {
        "name": command,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": router_command(service, namespace, spec, command, inference_pool),
        "env": [
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            *_api_key_env(spec),
        ],
        "ports": ports,
        "resources": dict(part.get("resources") or {}),
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH_DIR}, _kv_keys_mount()],
        "securityContext": _container_security(),
        **_probes(ROUTER_STARTUP_FAILURES),
    }
    volumes = [{"name": "scratch", "emptyDir": {}}, _kv_keys_volume(service, spec, ROUTER_FILES)]
    tenants = spec[ROUTER].get("tenantsSecret")
    if tenants is not None:
        container["volumeMounts"].append({"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True})
        volumes.append({"name": "tenants", "secret": {"secretName": tenants["name"]}})
    if _router_reads_model(spec["model"]):
        container["volumeMounts"].append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
        volumes.append(_model_volume(spec["model"]))
    pod_spec = {
        "serviceAccountName": object_name(service, ROUTER),
        "containers": [container],
        "volumes": volumes,
        "securityContext": _pod_security(),
    }
    return {"metadata": {"labels": labels(service, command)}, "spec": pod_spec}
