"""Names the operator and the cluster agree on: the CRD coordinates, object names, labels, ports.

Everything another component reads (the router's discovery selector, the chart's RBAC, the CRDs'
printer columns) is spelled here once; the manifest builders and handlers only import it.
"""

from pdserve.api import roles

GROUP = "pdserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PDSERVICES = "pdservices"
PDPOOLS = "pdpools"

ROUTER = roles.ROUTER
PREFILL = roles.PREFILL.name
DECODE = roles.DECODE.name
ENGINE_ROLES = tuple(role.name for role in roles.POOL_ROLES)
ROLES = (ROUTER, PREFILL, DECODE)
# The endpoint picker (`pdserve epp`) a gateway with the Inference Extension consults, when spec.endpointPicker is on.
EPP = "epp"
EPP_GRPC_PORT = 9002
# The Inference Extension's pool of model servers, which the operator writes for the picker (the gateway's setup
# installs its CRD).
INFERENCE_POOL = ("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")

# Container ports: the defaults of `pdserve router|prefill|decode` (pdserve.api.roles), fixed so
# that Services, probes and the router's discovery never have to ask the pods.
PORTS = {ROUTER: roles.ROUTER_PORT, EPP: 9003, **{role.name: role.default_port for role in roles.POOL_ROLES}}
KV_SIDE_CHANNEL_PORT = roles.POD_KV_SIDE_CHANNEL_PORT
MODEL_DIR = "/models/model"

# The PDService's keys (pdserve/api/keys.py: the router's signing key and its public half, the engines'
# side-channel key, the KV-event key): the Secret's name suffix and component, and where the pods mount the
# items their role holds (routers: keys.ROUTER_FILES; engines: keys.ENGINE_FILES).
KV_KEYS = "kv-keys"
KV_KEYS_DIR = "/etc/pdserve/kv-keys"
# Where engine pods mount the KV tiers' volumes (a pool's kvCache.disk and kvCache.shared).
KV_DISK_DIR = "/var/cache/pdserve/kv-disk"
KV_SHARED_DIR = "/var/cache/pdserve/kv-shared"
# The NetworkPolicy on the engine pods: its name suffix and component.
ENGINES = "engines"

OPERATOR = "pdserve-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = roles.ROLE_LABEL
LABEL_SERVICE = "pdserve.io/service"
# On engine pods: the pool's tensor-parallel size (ranks, one worker process each), for people and tools.
TENSOR_PARALLEL_ANNOTATION = "pdserve.io/tensor-parallel-size"


def object_name(service: str, role: str) -> str:
    """Deployment, Service (and for engines PDPool) of one role: `<service>-<role>`."""
    return f"{service}-{role}"


def kv_keys_name(service: str) -> str:
    """The Secret the operator creates when spec.kvTransfer.secretName names none: `<service>-kv-keys`."""
    return f"{service}-{KV_KEYS}"


def engines_policy_name(service: str) -> str:
    """The NetworkPolicy on the engine pods: `<service>-engines`."""
    return f"{service}-{ENGINES}"


def service_labels(service: str, component: str) -> dict[str, str]:
    """The labels of an object of the whole PDService rather than of one role (the KV Secret, the
    NetworkPolicy): those of `labels` but the role."""
    return {
        LABEL_NAME: "pdserve",
        LABEL_INSTANCE: service,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: OPERATOR,
        LABEL_SERVICE: service,
    }


def labels(service: str, role: str) -> dict[str, str]:
    """The labels every object of one role carries, pods included."""
    return {**service_labels(service, role), LABEL_ROLE: role}


def selector(service: str, role: str) -> dict[str, str]:
    """The pod selector of one role (Deployment selector, Service selector, PDPool status.selector)."""
    return {LABEL_INSTANCE: service, LABEL_ROLE: role}


def selector_string(service: str, role: str) -> str:
    """`selector()` in label-selector syntax, as the scale subresource and HPAs read it."""
    return ",".join(f"{key}={value}" for key, value in selector(service, role).items())


def router_url(service: str, namespace: str) -> str:
    return f"http://{object_name(service, ROUTER)}.{namespace}.svc:{PORTS[ROUTER]}"
