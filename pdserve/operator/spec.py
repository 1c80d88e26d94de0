"""A PDService spec as the operator reads it: the CRD's defaults, the checks a schema cannot express, and
the numbers its Kubernetes-style values stand for.

The API server applies the CRD's defaults, but the operator fills them again (`with_defaults`) so
that it never depends on them (older objects, emulated API servers); tests keep the two in step.
One default depends on another field, so the CRD cannot hold it: a pool's `gpus` (GPUs per pod)
defaults to its `tensorParallelSize` (one GPU per rank). `problems` lists what makes a spec
unusable, before anything is created for it. `quantity_bytes` and `duration_seconds` read a
quantity ("8Gi") and a duration ("12h") as the engine flags want them (a pool's kvCache).
"""

import copy
import decimal
import re
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.operator.names import DECODE, ENGINE_ROLES, PREFILL, ROUTER

MODEL_SOURCES = ("pvc", "hostPath", "huggingface")
KV_BACKENDS = ("nixl", "tcp")
LOAD_FAILURE = ("recompute", "fail")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

# Flags the operator writes into the pod commands; a user's value would contradict the ports,
# probes, volumes or discovery the operator wires around them.
RESERVED_ENGINE_FLAGS = (
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--kv-transfer",
    "--kv-side-channel-host",
    "--kv-side-channel-port",
    "--kv-lease-seconds",
    "--kv-transfer-timeout",
    "--kv-load-failure",
    "--kv-keys",
    "--kv-insecure",
    "--kv-nixl-unbounded",
)
# UCX over RDMA only (rc, with the GPU copy transports it needs for VRAM): NIXL then moves KV between pods where
# an RDMA device is present, and the checked TCP transport elsewhere. UCX over tcp or shared memory would let
# every peer read and write an engine's whole memory (docs/faults.md).
DEFAULT_UCX_TRANSPORTS = "rc,cuda_copy,gdr_copy,self"
# The engine's tensor-parallel flags: the pool's tensorParallelSize is the one place for the size,
# because the pods' GPUs and /dev/shm volume follow it (more than one rank implies the `mp` executor).
TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--distributed-executor-backend")
MAX_TENSOR_PARALLEL_SIZE = 64
# The engine's KV-tier flags: a pool's kvCache sets them, because the volumes they name are the operator's
# (a path of the user's would name a folder no volume backs; a size of theirs could outgrow the volume).
KV_TIER_FLAGS = (
    "--kv-tier-host-bytes",
    "--kv-tier-disk",
    "--kv-tier-disk-bytes",
    "--kv-tier-shared",
    "--kv-tier-shared-bytes",
    "--kv-tier-shared-read-only",
    "--no-kv-tier-shared-read-only",
    "--kv-tier-max-age",
)
RESERVED_ROUTER_FLAGS = (
    "--host",
    "--port",
    "--discovery",
    "--namespace",
    "--selector",
    "--inference-pool",
    "--prefill",
    "--decode",
    "--kv-keys",
    "--kv-insecure",
)

# `<name>-prefill` must still be a DNS-1035 label (Services), so the name leaves room for the suffix.
MAX_NAME_LENGTH = 63 - len("-prefill")
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# A Secret's name: a DNS-1123 subdomain.
MAX_SECRET_NAME_LENGTH = 253
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CLAIM_NAME = _SECRET_NAME  # a PersistentVolumeClaim's name is a DNS-1123 subdomain too
# A Kubernetes quantity of bytes, loosely: a plain or decimal number with an optional binary, decimal
# or exponent suffix (no sign, no milli: a size). The API server has the last word.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE]|[eE][0-9]+)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_BINARY_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
# Beyond 10^18 bytes a quantity is a typo, not a size (and the number would only grow).
_MAX_EXPONENT = 18
# kvCache.maxAge as a duration: one or more numbers with a unit, e.g. 12h, 1h30m, 7d, 90s.
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?[smhd])+$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# An emptyDir that outgrows its sizeLimit gets its pod evicted, so the disk tier's own bound
# (--kv-tier-disk-bytes) is this share of kvCache.disk.size: the rest is headroom for what the bound
# does not count (files being written, the file system's own overhead).
KV_DISK_SHARE = (9, 10)
_PERCENT = re.compile(r"^[0-9]+%$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# On a command line every user of the node can read it: the key comes from spec.apiKeySecret.
API_KEY_FLAG = "--api-key"


def quantity_bytes(text: str) -> int:
    """The bytes of a Kubernetes quantity that `QUANTITY_PATTERN` accepts ("8Gi", "1.5G", "1e9", "4096"),
    rounded up as the API server rounds them; ValueError for anything else."""
    match = _QUANTITY.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a quantity of bytes: {text!r}")
    number, suffix = decimal.Decimal(match.group(1)), match.group(3) or ""
    if suffix in _BINARY_SUFFIXES:
        scale = decimal.Decimal(_BINARY_SUFFIXES[suffix])
    elif suffix in _DECIMAL_SUFFIXES:
        scale = decimal.Decimal(_DECIMAL_SUFFIXES[suffix])
    elif int(suffix[1:]) <= _MAX_EXPONENT:  # an exponent: e9, E3
        scale = decimal.Decimal(10) ** int(suffix[1:])
    else:
        raise ValueError(f"too large a quantity: {text!r}")
    return int((number * scale).to_integral_value(rounding=decimal.ROUND_CEILING))


def duration_seconds(value: Any) -> float:
    """Seconds from a whole number of seconds (3600) or a duration ("12h", "1h30m", "7d", "90s");
    ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str) or not _DURATION.fullmatch(value):
        raise ValueError(f"not a duration: {value!r}")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(value))


def disk_tier_bytes(size: str) -> int:
    """--kv-tier-disk-bytes for a disk volume of `size` (a quantity): `KV_DISK_SHARE` of it."""
    share, whole = KV_DISK_SHARE
    return quantity_bytes(size) * share // whole


def plain(value: Any) -> Any:
    """A deep copy made of dicts and lists only (kopf hands out read-only mapping views)."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return copy.copy(value)


def with_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with every default of the CRD filled in (a new dict; the argument is not changed)."""
    full = plain(spec)
    full.setdefault("imagePullPolicy", "IfNotPresent")
    model = full.setdefault("model", {})
    model.setdefault("path", "")
    model.setdefault("revision", "main")
    kv = full.setdefault("kvTransfer", {})
    kv.setdefault("backend", "nixl")
    kv.setdefault("leaseSeconds", 30)
    kv.setdefault("transferTimeoutSeconds", 10)
    kv.setdefault("loadFailure", "recompute")
    kv.setdefault("ucxTransports", DEFAULT_UCX_TRANSPORTS)
    if isinstance(full.get("apiKeySecret"), dict):
        full["apiKeySecret"].setdefault("key", "api-key")
    router = full.setdefault(ROUTER, {})
    router.setdefault("replicas", 1)
    if isinstance(router, dict) and isinstance(router.get("tenantsSecret"), dict):
        router["tenantsSecret"].setdefault("key", "tenants.yaml")
    picker = full.setdefault(EPP_SPEC, {})
    if isinstance(picker, dict):
        picker.setdefault("enabled", False)
        picker.setdefault("replicas", 1)
        picker.setdefault("failureMode", "FailClose")
    _autoscaling_defaults(full.setdefault("autoscaling", {}))
    for role in ENGINE_ROLES:
        pool = full.setdefault(role, {})
        pool.setdefault("replicas", 1)
        pool.setdefault("maxUnavailable", 1)
        tensor_parallel = pool.setdefault("tensorParallelSize", 1)
        # One GPU per rank; an unusable size (reported by `problems`) falls back to the old default.
        pool.setdefault("gpus", tensor_parallel if _is_tensor_parallel_size(tensor_parallel) else 1)
        cache = pool.get("kvCache")
        if isinstance(cache, dict) and isinstance(cache.get("shared"), dict):
            cache["shared"].setdefault("readOnly", False)
    return full


def problems(name: str, spec: Mapping[str, Any]) -> list[str]:
    """Why this PDService cannot be served, one sentence each; empty when it can."""
    if not _NAME.match(name) or len(name) > MAX_NAME_LENGTH:
        return [f"name {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters"]
    sections = ("model", "kvTransfer", "autoscaling", ROUTER, EPP_SPEC, PREFILL, DECODE)
    wrong = [key for key in sections if not isinstance(spec.get(key, {}), Mapping)]
    if wrong:
        return [f"spec.{key} must be an object" for key in wrong]
    spec = with_defaults(spec)
    found: list[str] = []
    if not isinstance(spec.get("image"), str) or not spec["image"]:
        found.append("spec.image is required")
    if spec["imagePullPolicy"] not in PULL_POLICIES:
        found.append(f"spec.imagePullPolicy must be one of {', '.join(PULL_POLICIES)}")
    found += _model_problems(spec["model"])
    found += _kv_problems(spec["kvTransfer"])
    found += _api_key_problems(spec.get("apiKeySecret"))
    found += _count_problems(f"spec.{ROUTER}.replicas", spec[ROUTER]["replicas"])
    found += _args_problems(f"spec.{ROUTER}.args", spec[ROUTER].get("args", []), RESERVED_ROUTER_FLAGS)
    found += _resources_problems(f"spec.{ROUTER}.resources", spec[ROUTER].get("resources", {}))
    found += _picker_problems(spec[EPP_SPEC])
    for role in (PREFILL, DECODE):
        found += _pool_problems(f"spec.{role}", spec[role])
    found += _autoscaling_problems(spec["autoscaling"])
    return found


# spec.autoscaling's defaults (the CRD's too); `slo.ttftSeconds`, `slo.tpotSeconds` and
# `profile.configMap` have none: enabling autoscaling needs them.
AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "intervalSeconds": 60,
    "cooldownSeconds": 180,
    "scaleDownDecisions": 3,
    "maxStep": 2,
    "horizonSeconds": 120,
    "correction": {"min": 0.5, "max": 2.0},
    "slo": {"attainment": 0.9},
    "profile": {"key": "profile.json"},
    "metrics": {"source": "router"},
    PREFILL: {"minReplicas": 1, "maxReplicas": 8},
    DECODE: {"minReplicas": 1, "maxReplicas": 16},
}
METRICS_SOURCES = ("router", "prometheus")
EPP_SPEC = "endpointPicker"
FAILURE_MODES = ("FailClose", "FailOpen")  # the InferencePool's endpointPickerRef.failureMode
_CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _autoscaling_defaults(autoscaling: dict[str, Any]) -> None:
    for key, value in AUTOSCALING_DEFAULTS.items():
        if isinstance(value, dict):
            section = autoscaling.setdefault(key, {})
            if isinstance(section, dict):
                for inner, default in value.items():
                    section.setdefault(inner, default)
        else:
            autoscaling.setdefault(key, value)


def _autoscaling_problems(autoscaling: Any) -> list[str]:
    where = "spec.autoscaling"
    if not isinstance(autoscaling, dict):
        return [f"{where} must be an object"]
    if not isinstance(autoscaling["enabled"], bool):
        return [f"{where}.enabled must be true or false"]
    if not autoscaling["enabled"]:
        return []  # what else it says is read only when it is turned on
    wrong = [key for key, value in AUTOSCALING_DEFAULTS.items() if isinstance(value, dict)]
    wrong = [key for key in wrong if not isinstance(autoscaling[key], dict)]
    if wrong:
        return [f"{where}.{key} must be an object" for key in wrong]
    found = []
    for key in ("intervalSeconds", "cooldownSeconds", "horizonSeconds"):
        found += _positive_problems(f"{where}.{key}", autoscaling[key], minimum=1)
    for key in ("scaleDownDecisions", "maxStep"):
        if isinstance(autoscaling[key], bool) or not isinstance(autoscaling[key], int) or autoscaling[key] < 1:
            found.append(f"{where}.{key} must be an integer >= 1")
    slo = autoscaling["slo"]
    for key in ("ttftSeconds", "tpotSeconds"):
        found += _positive_problems(f"{where}.slo.{key}", slo.get(key), minimum=0)
    attainment = slo["attainment"]
    if isinstance(attainment, bool) or not isinstance(attainment, int | float) or not 0 < attainment <= 1:
        found.append(f"{where}.slo.attainment must be a fraction above 0 and at most 1")
    correction = autoscaling["correction"]
    low, high = correction.get("min"), correction.get("max")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not 0 < low <= 1 <= high:
        found.append(f"{where}.correction must have 0 < min <= 1 <= max")
    profile = autoscaling["profile"]
    name = profile.get("configMap")
    if not isinstance(name, str) or not _SECRET_NAME.fullmatch(name) or len(name) > MAX_SECRET_NAME_LENGTH:
        found.append(f"{where}.profile.configMap must name a ConfigMap holding the profile (`pdserve profile`)")
    for key in ("key", "decodeKey"):
        if key in profile and (not isinstance(profile[key], str) or not _CONFIG_MAP_KEY.fullmatch(profile[key])):
            found.append(f"{where}.profile.{key} must be a key of a ConfigMap (letters, digits, '-', '_', '.')")
    metrics = autoscaling["metrics"]
    if metrics["source"] not in METRICS_SOURCES:
        found.append(f"{where}.metrics.source must be one of {', '.join(METRICS_SOURCES)}")
    elif metrics["source"] == "prometheus":
        url = metrics.get("prometheusURL")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            found.append(f"{where}.metrics.prometheusURL must be an http(s) URL when the source is prometheus")
    if "selector" in metrics and not isinstance(metrics["selector"], str):
        found.append(f'{where}.metrics.selector must be a string such as {{namespace="ns"}}')
    for role in ENGINE_ROLES:
        bounds = autoscaling[role]
        least, most = bounds.get("minReplicas"), bounds.get("maxReplicas")
        counts = all(isinstance(v, int) and not isinstance(v, bool) for v in (least, most))
        if not counts or not 1 <= least <= most:
            found.append(f"{where}.{role} must have integers 1 <= minReplicas <= maxReplicas")
    return found


def _positive_problems(where: str, value: Any, minimum: float) -> list[str]:
    """A number of at least `minimum`, or (minimum 0) above 0."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (value < minimum if minimum else value <= 0):
        return [f"{where} must be a number {f'>= {minimum}' if minimum else 'above 0'}"]
    return []


def _model_problems(model: dict[str, Any]) -> list[str]:
    source = model.get("source")
    if source not in MODEL_SOURCES:
        return [f"spec.model.source must be one of {', '.join(MODEL_SOURCES)}"]
    needed = {"pvc": "claimName", "hostPath": "hostPath", "huggingface": "repo"}[source]
    found = []
    if not isinstance(model.get(needed), str) or not model[needed]:
        found.append(f"spec.model.{needed} is required when spec.model.source is {source}")
    elif source == "hostPath" and not model["hostPath"].startswith("/"):
        found.append("spec.model.hostPath must be an absolute path")
    path = model["path"]
    if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/"):
        found.append("spec.model.path must be a relative folder inside the volume (no '..')")
    return found


def _kv_problems(kv: dict[str, Any]) -> list[str]:
    found = []
    if kv["backend"] not in KV_BACKENDS:
        found.append(f"spec.kvTransfer.backend must be one of {', '.join(KV_BACKENDS)}")
    if kv["loadFailure"] not in LOAD_FAILURE:
        found.append(f"spec.kvTransfer.loadFailure must be one of {', '.join(LOAD_FAILURE)}")
    for key in ("leaseSeconds", "transferTimeoutSeconds"):
        value = kv[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 1:
            found.append(f"spec.kvTransfer.{key} must be a number >= 1")
    if not isinstance(kv["ucxTransports"], str) or not kv["ucxTransports"]:
        found.append("spec.kvTransfer.ucxTransports must be a non-empty string")
    secret = kv.get("secretName")
    if "secretName" in kv and (
        not isinstance(secret, str) or not _SECRET_NAME.fullmatch(secret) or len(secret) > MAX_SECRET_NAME_LENGTH
    ):
        found.append(
            f"spec.kvTransfer.secretName must be a Secret's name (a DNS-1123 subdomain of at most "
            f"{MAX_SECRET_NAME_LENGTH} characters)"
        )
    return found


def _api_key_problems(secret: Any) -> list[str]:
    if secret is None:
        return []
    if not isinstance(secret, dict):
        return ["spec.apiKeySecret must be an object with name and key"]
    found = []
    name = secret.get("name")
    if not isinstance(name, str) or not _SECRET_NAME.fullmatch(name) or len(name) > MAX_SECRET_NAME_LENGTH:
        found.append("spec.apiKeySecret.name must be a Secret's name (a DNS-1123 subdomain)")
    if not isinstance(secret["key"], str) or not _SECRET_KEY.fullmatch(secret["key"]):
        found.append("spec.apiKeySecret.key must be a key of a Secret (letters, digits, '-', '_', '.')")
    return found


def _pool_problems(where: str, pool: dict[str, Any]) -> list[str]:
    found = _count_problems(f"{where}.replicas", pool["replicas"]) + _count_problems(f"{where}.gpus", pool["gpus"])
    found += _tensor_parallel_problems(where, pool)
    args = pool.get("engineArgs", [])
    found += _args_problems(f"{where}.engineArgs", args, RESERVED_ENGINE_FLAGS)
    for flags, field in ((TENSOR_PARALLEL_FLAGS, "tensorParallelSize"), (KV_TIER_FLAGS, "kvCache")):
        taken = _taken_flags(args, flags) if _is_string_list(args) else []
        if taken:
            found.append(f"{where}.engineArgs must not set {', '.join(taken)} (set {where}.{field} instead)")
    found += _kv_cache_problems(where, pool)
    shm = pool.get("shmSize")
    if "shmSize" in pool and (not isinstance(shm, str) or not _QUANTITY.fullmatch(shm)):
        found.append(f"{where}.shmSize must be a Kubernetes quantity of bytes such as 2Gi or 512Mi")
    found += _resources_problems(f"{where}.resources", pool.get("resources", {}))
    selector = pool.get("nodeSelector", {})
    if not isinstance(selector, dict) or not all(isinstance(v, str) for v in selector.values()):
        found.append(f"{where}.nodeSelector must map strings to strings")
    for key in ("tolerations", "topologySpreadConstraints"):
        items = pool.get(key, [])
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            found.append(f"{where}.{key} must be a list of objects")
    if not isinstance(pool.get("affinity", {}), dict):
        found.append(f"{where}.affinity must be an object")
    unavailable = pool["maxUnavailable"]
    is_count = isinstance(unavailable, int) and not isinstance(unavailable, bool) and unavailable >= 0
    if not is_count and not (isinstance(unavailable, str) and _PERCENT.fullmatch(unavailable)):
        found.append(f"{where}.maxUnavailable must be an integer >= 0 or a percentage such as 25%")
    return found


def _kv_cache_problems(where: str, pool: dict[str, Any]) -> list[str]:
    """A pool's kvCache: the KV tiers below its engines' block pools (all optional)."""
    if "kvCache" not in pool:
        return []
    cache, where = pool["kvCache"], f"{where}.kvCache"
    if not isinstance(cache, dict):
        return [f"{where} must be an object"]
    found = []
    if "hostMemory" in cache:
        found += _size_problems(f"{where}.hostMemory", cache["hostMemory"], quantity_bytes)
        if pool["gpus"] == 0 and not isinstance(pool["gpus"], bool):
            found.append(
                f"{where}.hostMemory needs GPUs: with gpus 0 the engines run on the CPU, whose KV cache already is "
                "host memory"
            )
    if "disk" in cache:
        disk = cache["disk"]
        if not isinstance(disk, dict):
            found.append(f"{where}.disk must be an object with a size")
        else:
            found += _size_problems(f"{where}.disk.size", disk.get("size"), disk_tier_bytes)
    if "shared" in cache:
        found += _shared_tier_problems(f"{where}.shared", cache["shared"])
    if "maxAge" in cache:
        try:
            positive = duration_seconds(cache["maxAge"]) > 0
        except ValueError:
            positive = False
        if not positive:
            found.append(f"{where}.maxAge must be whole seconds above 0 or a duration such as 12h, 90m or 7d")
        elif "disk" not in cache and "shared" not in cache:
            found.append(f"{where}.maxAge needs disk or shared: it bounds how long their block files are kept")
    return found


def _shared_tier_problems(where: str, shared: Any) -> list[str]:
    if not isinstance(shared, dict):
        return [f"{where} must be an object with a claimName"]
    found = []
    claim = shared.get("claimName")
    if not isinstance(claim, str) or not _CLAIM_NAME.fullmatch(claim) or len(claim) > MAX_SECRET_NAME_LENGTH:
        found.append(f"{where}.claimName must name a PersistentVolumeClaim (a DNS-1123 subdomain)")
    if not isinstance(shared["readOnly"], bool):
        found.append(f"{where}.readOnly must be true or false")
    if "size" in shared:
        found += _size_problems(f"{where}.size", shared["size"], quantity_bytes)
    elif shared["readOnly"] is not True:
        found.append(f"{where}.size is required unless readOnly: the bound of what this pool writes there")
    return found


def _size_problems(where: str, size: Any, to_bytes: Callable[[str], int]) -> list[str]:
    """A quantity of bytes whose value for the engine (`to_bytes` of it) is at least one byte."""
    try:
        usable = to_bytes(size) >= 1
    except ValueError:
        usable = False
    return [] if usable else [f"{where} must be a Kubernetes quantity of bytes such as 8Gi or 512Mi"]


def _is_tensor_parallel_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_TENSOR_PARALLEL_SIZE


def _tensor_parallel_problems(where: str, pool: dict[str, Any]) -> list[str]:
    size, gpus = pool["tensorParallelSize"], pool["gpus"]
    if not _is_tensor_parallel_size(size):
        return [f"{where}.tensorParallelSize must be an integer from 1 to {MAX_TENSOR_PARALLEL_SIZE}"]
    # Each rank drives a GPU of its own; with gpus 0 (CPU pods) the ranks are processes on the CPU.
    if not _count_problems(f"{where}.gpus", gpus) and 0 < gpus < size:
        return [
            f"{where}.gpus ({gpus}) must be 0 (CPU) or at least {where}.tensorParallelSize ({size}): "
            "each tensor-parallel rank needs a GPU of its own"
        ]
    return []


def _picker_problems(picker: Mapping[str, Any]) -> list[str]:
    where = f"spec.{EPP_SPEC}"
    found = [] if isinstance(picker["enabled"], bool) else [f"{where}.enabled must be true or false"]
    found += _count_problems(f"{where}.replicas", picker["replicas"])
    found += _args_problems(f"{where}.args", picker.get("args", []), (*RESERVED_ROUTER_FLAGS, "--grpc-port"))
    found += _resources_problems(f"{where}.resources", picker.get("resources", {}))
    if picker["failureMode"] not in FAILURE_MODES:
        found.append(f"{where}.failureMode must be one of {', '.join(FAILURE_MODES)}")
    return found


def _count_problems(where: str, value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return [f"{where} must be an integer >= 0"]
    return []


def _args_problems(where: str, args: Any, reserved: tuple[str, ...]) -> list[str]:
    if not _is_string_list(args):
        return [f"{where} must be a list of strings"]
    taken = _taken_flags(args, reserved)
    if taken:
        return [f"{where} must not set {', '.join(taken)} (the operator sets them)"]
    if _taken_flags(args, (API_KEY_FLAG,)):
        return [f"{where} must not set {API_KEY_FLAG} (name a Secret holding the key in spec.apiKeySecret)"]
    return []


def _is_string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _taken_flags(args: list[str], reserved: tuple[str, ...]) -> list[str]:
    """The reserved flags that `args` set, as argparse would read them: `--flag`, `--flag=value`, and
    unambiguous prefixes (`--mod` for `--model`, `-t` for `-tp`)."""
    heads = {arg.split("=", 1)[0] for arg in args if arg.startswith("-")} - {"-", "--"}
    # "--t" is no prefix of "-tp", nor "-t" of "--tokenizer": dashes count as part of the prefix.
    return sorted({flag for head in heads for flag in reserved if flag.startswith(head)})


def _resources_problems(where: str, resources: Any) -> list[str]:
    if not isinstance(resources, dict) or set(resources) - {"limits", "requests", "claims"}:
        return [f"{where} must be a ResourceRequirements object (limits, requests, claims)"]
    for section in ("limits", "requests"):
        if "nvidia.com/gpu" in (resources.get(section) or {}):
            return [f"{where}.{section} must not name nvidia.com/gpu (set the pool's gpus instead)"]
    return []
