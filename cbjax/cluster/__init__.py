"""Clusters: replicas behind a pluggable router, and prefill/decode disaggregation (no jax)."""

from cbjax.cluster.driver import ClusterSim
from cbjax.cluster.engine import ClusterEngine
from cbjax.cluster.prefix_index import PrefixIndex
from cbjax.cluster.router import (
    ROUTER_CLASSES, ReplicaSnapshot, ReplicaState, RouteRequest, Router, make_router, outstanding,
)  # fmt: skip

__all__ = [
    "ClusterEngine", "ClusterSim", "PrefixIndex", "ROUTER_CLASSES", "ReplicaSnapshot", "ReplicaState", "RouteRequest", "Router",
    "make_router", "outstanding",
]  # fmt: skip
