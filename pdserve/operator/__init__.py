"""The pdserve Kubernetes operator (kopf): turns each PDService into PDPools, Deployments, Services
and router RBAC, keeps every engine pool at its PDPool's size, and reports readiness in status.

Modules: names (shared names and labels), spec (defaults and validation), pods and manifests (pure
object builders), status (pure status computation), kube (client access, create-or-patch),
reconcile (what to do), handlers (when, kopf), runner (the `pdserve operator` entry point),
scale_down (which pods a scale-down removes), scrape and load (pods' and routers' metrics read),
autoscaler (the pools' sizes from measured traffic and the planner).
"""

from pdserve.operator.runner import run

__all__ = ["run"]
