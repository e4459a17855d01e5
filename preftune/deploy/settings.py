"""The `deploy:` config section: where and how `preftune render` places the training job.

Defaults are the seed's job: 3 x p5en.48xlarge (8 H200 each) on spot capacity, gang-scheduled by
Volcano, checkpoints on a ReadWriteMany claim. `check_deploy` rejects values that would render a
job Kubernetes refuses or that cannot save on preemption; it raises UserError naming the key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from preftune.errors import UserError

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label, at most 63 characters
QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE])?$")
DURATION = re.compile(r"^(([0-9]+(s|m|h))+|Never)$")  # Karpenter's duration format
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
EC2_ALIAS_FAMILIES = ("al2", "al2023", "bottlerocket", "windows2019", "windows2022", "windows2025")  # EC2NodeClass CEL

# Seconds Kubernetes waits after SIGTERM beyond the run's own grace (the save, the upload, the exit).
TERMINATION_MARGIN_SECONDS = 30
SPOT_NOTICE_SECONDS = 120  # EC2's spot interruption warning


@dataclass
class DeployConfig:
    name: str = "preftune"  # the Job's name; prefix of its ConfigMap
    namespace: str = "training-pipeline"
    scheduler: str = "volcano"  # volcano (gang-scheduled vcjob) | kubernetes (batch/v1 Indexed Job)
    queue: str = "training-queue"  # Volcano queue (rendered too)
    nodes: int = 3  # pods, one per node
    gpus_per_node: int = 8
    instance_types: list[str] = field(default_factory=lambda: ["p5en.48xlarge"])
    capacity_type: str = "spot"  # spot | on-demand
    zones: list[str] = field(default_factory=list)  # [] = any zone of the subnets
    image: str = "preftune:latest"  # the image the README builds; push it and name it here
    image_pull_policy: str = "IfNotPresent"  # Always | IfNotPresent | Never
    cpu: str | int = "160"  # requested per pod (p5en.48xlarge: 192 vCPU)
    memory: str = "1600Gi"  # requested per pod (p5en.48xlarge: 2 TiB)
    shm_size: str = "256Gi"  # memory-backed /dev/shm for NCCL and data loaders
    efa: bool = True  # request EFA devices and give the nodes EFA interfaces
    efa_interfaces: int = 16  # EFA devices per node (p5en.48xlarge: 16)
    checkpoint_claim: str | None = "preftune-checkpoints"  # ReadWriteMany PVC; null = checkpoint_uri only
    checkpoint_mount: str = "/checkpoints"  # where the claim is mounted; a relative output_dir goes under it
    storage_class: str | None = None  # an RWX-capable class (FSx for Lustre, EFS); null = cluster default
    storage_size: str = "1200Gi"  # PVC size (FSx for Lustre's smallest is 1.2 TiB)
    env: dict[str, str | int | float] = field(default_factory=dict)  # extra environment, e.g. NCCL_DEBUG: INFO
    service_account: str | None = None  # for S3 access via IRSA / Pod Identity
    labels: dict[str, str] = field(default_factory=dict)  # added to every object and pod
    max_retry: int = 100  # restarts of the whole job (each spot loss is one)
    termination_grace_seconds: int | None = None  # null = preemption_grace_seconds + 30
    node_pool: str = "training-spot-pool"  # Karpenter NodePool
    node_class: str = "training-gpu-class"  # Karpenter EC2NodeClass
    cluster: str = "training-cluster"  # EKS cluster; subnets and security groups tagged karpenter.sh/discovery
    node_role: str | None = None  # IAM role of the nodes; null = KarpenterNodeRole-<cluster>
    ami_alias: str = "al2023@v20260807"  # pinned EKS AMI (the NVIDIA variant is chosen for GPU types)
    root_volume_size: str = "200Gi"
    expire_after: str = "720h"  # nodes are replaced after this (forcefully: the run saves and restarts)
    consolidate_after: str = "5m"  # an empty node is removed after this
    max_gpus: int | None = None  # NodePool GPU limit; null = (nodes + 1) x gpus_per_node


def termination_grace(deploy: DeployConfig, preemption_grace_seconds: float) -> int:
    """The pod's terminationGracePeriodSeconds: the run's own grace plus a margin for the exit."""
    if deploy.termination_grace_seconds is not None:
        return deploy.termination_grace_seconds
    return math.ceil(preemption_grace_seconds) + TERMINATION_MARGIN_SECONDS


def node_role(deploy: DeployConfig) -> str:
    return deploy.node_role or f"KarpenterNodeRole-{deploy.cluster}"


def max_gpus(deploy: DeployConfig) -> int:
    # one node above the job: a spot replacement can start before the interrupted node is gone
    return deploy.max_gpus if deploy.max_gpus is not None else (deploy.nodes + 1) * deploy.gpus_per_node


def check_deploy(deploy: DeployConfig, preemption_grace_seconds: float, checkpoint_uri: str | None) -> None:
    """Raise UserError naming the first `deploy.*` key whose value cannot render a working job.
    Choices and numeric ranges are in config.CHOICES / BOUNDS, checked before this."""
    def bad(key: str, message: str) -> UserError:
        return UserError(message, where=f"deploy.{key}")

    if deploy.max_gpus is not None and deploy.max_gpus < deploy.nodes * deploy.gpus_per_node:
        raise bad("max_gpus", f"{deploy.max_gpus} is below the job's {deploy.nodes * deploy.gpus_per_node} GPUs")
    for key in ("name", "namespace", "queue", "node_pool", "node_class") + (
            ("checkpoint_claim",) if deploy.checkpoint_claim else ()):
        value = getattr(deploy, key)
        if not DNS_LABEL.match(value) or len(value) > 63:
            raise bad(key, f"'{value}' is not a Kubernetes name (lowercase letters, digits, '-'; at most 63)")
    if len(deploy.name) > 40:  # pod names (and hostnames) NAME-worker-INDEX must stay within 63 characters
        raise bad("name", f"'{deploy.name}' is longer than 40 characters")
    for key in ("cpu", "memory", "shm_size", "storage_size", "root_volume_size"):
        if not QUANTITY.match(str(getattr(deploy, key))):
            raise bad(key, f"'{getattr(deploy, key)}' is not a Kubernetes quantity (e.g. 160, 1600Gi)")
    for key in ("expire_after", "consolidate_after"):
        if not DURATION.match(getattr(deploy, key)):
            raise bad(key, f"'{getattr(deploy, key)}' is not a duration like 720h, 5m or Never")
    if not deploy.instance_types or not all(deploy.instance_types):
        raise bad("instance_types", "list at least one EC2 instance type")
    if not deploy.image:
        raise bad("image", "name the container image")
    if not deploy.checkpoint_mount.startswith("/"):
        raise bad("checkpoint_mount", f"'{deploy.checkpoint_mount}' is not an absolute path")
    if not re.match(r"^[a-zA-Z0-9]+@.+$", deploy.ami_alias) or deploy.ami_alias.split("@")[0] not in EC2_ALIAS_FAMILIES:
        raise bad("ami_alias", f"'{deploy.ami_alias}' is not family@version with a family of "
                  f"{', '.join(EC2_ALIAS_FAMILIES)}")
    for env_key in deploy.env:
        if not ENV_NAME.match(env_key):
            raise bad(f"env.{env_key}", "not a valid environment variable name")
    for key, value in deploy.labels.items():
        if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value) or len(value) > 63:
            raise bad(f"labels.{key}", f"'{key}: {value}' is not a valid Kubernetes label")
    if not deploy.checkpoint_claim and not checkpoint_uri:
        raise bad("checkpoint_claim", "no checkpoint storage: name a ReadWriteMany claim or set checkpoint_uri, "
                  "or a restarted job starts over")
    grace = deploy.termination_grace_seconds
    if grace is not None and grace <= preemption_grace_seconds:
        raise bad("termination_grace_seconds",
                  f"{grace} s does not exceed preemption_grace_seconds ({preemption_grace_seconds:g} s): "
                  "the pod would be killed before the run saves")
