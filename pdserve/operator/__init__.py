"""The pdserve Kubernetes operator (kopf): turns each PDService into PDPools, Deployments, Services
and router RBAC, keeps every engine pool at its PDPool's size, and reports readiness in status.

Modules: names (shared names and labels), spec (defaults and validation), pods and manifests (pure
object builders), status (pure status computation), kube (client access, create-or-patch),
reconcile (what to do), handlers (when, kopf), runner (the `pdserve operator` entry point).
"""

from pdserve.operator.runner import run

__all__ = ["run"]
