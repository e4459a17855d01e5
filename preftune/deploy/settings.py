"""Values the manifests derive from the `deploy:` section (declared in
preftune/config/schema.py)."""
from __future__ import annotations

import math

from preftune.config import DeployConfig

# Seconds Kubernetes waits after SIGTERM beyond the run's own grace (the save, the upload, the
# exit).
TERMINATION_MARGIN_SECONDS = 30
SPOT_NOTICE_SECONDS = 120  # EC2's spot interruption warning


def termination_grace(deploy: DeployConfig, preemption_grace_seconds: float) -> int:
    """The pod's terminationGracePeriodSeconds: the run's own grace plus a margin for the exit."""
    if deploy.termination_grace_seconds is not None:
        return deploy.termination_grace_seconds
    return math.ceil(preemption_grace_seconds) + TERMINATION_MARGIN_SECONDS


def node_role(deploy: DeployConfig) -> str:
    return deploy.node_role or f"KarpenterNodeRole-{deploy.cluster}"


def max_gpus(deploy: DeployConfig) -> int:
    # one node above the job: a spot replacement can start before the interrupted node is gone
    return (
        deploy.max_gpus
        if deploy.max_gpus is not None
        else (deploy.nodes + 1) * deploy.gpus_per_node
    )
