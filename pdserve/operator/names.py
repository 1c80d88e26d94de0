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

# Container ports: the defaults of `pdserve router|prefill|decode` (pdserve.api.roles), fixed so
# that Services, probes and the router's discovery never have to ask the pods.
PORTS = {ROUTER: roles.ROUTER_PORT, **{role.name: role.default_port for role in roles.POOL_ROLES}}
KV_SIDE_CHANNEL_PORT = roles.POD_KV_SIDE_CHANNEL_PORT
MODEL_DIR = "/models/model"

OPERATOR = "pdserve-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = roles.ROLE_LABEL
LABEL_SERVICE = "pdserve.io/service"


def object_name(service: str, role: str) -> str:
    """Deployment, Service (and for engines PDPool) of one role: `<service>-<role>`."""
    return f"{service}-{role}"


def labels(service: str, role: str) -> dict[str, str]:
    """The labels every object of one role carries, pods included."""
    return {
        LABEL_NAME: "pdserve",
        LABEL_INSTANCE: service,
        LABEL_COMPONENT: role,
        LABEL_MANAGED_BY: OPERATOR,
        LABEL_ROLE: role,
        LABEL_SERVICE: service,
    }


def selector(service: str, role: str) -> dict[str, str]:
    """The pod selector of one role (Deployment selector, Service selector, PDPool status.selector)."""
    return {LABEL_INSTANCE: service, LABEL_ROLE: role}


def selector_string(service: str, role: str) -> str:
    """`selector()` in label-selector syntax, as the scale subresource and HPAs read it."""
    return ",".join(f"{key}={value}" for key, value in selector(service, role).items())


def router_url(service: str, namespace: str) -> str:
    return f"http://{object_name(service, ROUTER)}.{namespace}.svc:{PORTS[ROUTER]}"
