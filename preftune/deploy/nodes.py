"""Karpenter v1 NodePool and EC2NodeClass for the training nodes.

Nodes come when the job's pods are pending and go when they are empty. Consolidation and drift
never take a node from a running job (budgets of zero for those reasons); only emptiness and
`expireAfter` do, and a spot interruption, which the run answers by saving and exiting 75.
"""
from __future__ import annotations

from dataclasses import dataclass

from preftune.config import DeployConfig
from preftune.deploy.manifests import CAPACITY_TYPE, GPU, INSTANCE_TYPE, ZONE, metadata, taints
from preftune.deploy.settings import max_gpus, node_role
from preftune.errors import UserError

DISCOVERY_TAG = "karpenter.sh/discovery"


@dataclass(frozen=True)
class InstanceType:
    """What `preftune plan` needs of a node: its GPUs (memory in GB = 1e9 bytes, dense bf16 peak)
    and its host memory. From AWS's and NVIDIA's published specifications."""
    gpus: int
    gpu: str
    gpu_gb: float
    host_gb: float
    bf16_tflops: float  # dense, per GPU


GIB = 2 ** 30 / 1e9
INSTANCE_TYPES = {
    "p5en.48xlarge": InstanceType(8, "H200", 141, 2048 * GIB, 989),
    "p5e.48xlarge": InstanceType(8, "H200", 141, 2048 * GIB, 989),
    "p5.48xlarge": InstanceType(8, "H100", 80, 2048 * GIB, 989),
    "p4de.24xlarge": InstanceType(8, "A100 80GB", 80, 1152 * GIB, 312),
    "p4d.24xlarge": InstanceType(8, "A100 40GB", 40, 1152 * GIB, 312),
    "g6e.48xlarge": InstanceType(8, "L40S", 48, 1536 * GIB, 362),
}


def instance_type(name: str, where: str = "deploy.instance_types") -> InstanceType:
    """The hardware of an EC2 instance type; an unknown one is a UserError naming the known ones."""
    if name not in INSTANCE_TYPES:
        raise UserError(f"unknown node type {name!r} (known: {', '.join(INSTANCE_TYPES)})",
                        where=where)
    return INSTANCE_TYPES[name]


def node_pool(deploy: DeployConfig) -> dict:
    requirements = [{"key": CAPACITY_TYPE, "operator": "In", "values": [deploy.capacity_type]},
                    {"key": INSTANCE_TYPE, "operator": "In", "values": list(deploy.instance_types)}]
    if deploy.zones:
        requirements.append({"key": ZONE, "operator": "In", "values": list(deploy.zones)})
    return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool",
            "metadata": metadata(deploy, deploy.node_pool, namespaced=False),
            "spec": {
                "template": {"metadata": {"labels": {"app.kubernetes.io/name": "preftune"}},
                             "spec": {"requirements": requirements, "taints": taints(deploy),
                                      "expireAfter": deploy.expire_after,
                                      "nodeClassRef": {"group": "karpenter.k8s.aws",
                                                       "kind": "EC2NodeClass",
                                                       "name": deploy.node_class}}},
                "disruption": {"consolidationPolicy": "WhenEmpty",
                               "consolidateAfter": deploy.consolidate_after,
                               # no voluntary disruption of a busy node; empty nodes are removed
                               # freely
                               "budgets": [{"nodes": "0",
                                            "reasons": ["Underutilized", "Drifted"]}]},
                "limits": {GPU: max_gpus(deploy)}}}


def network_interfaces(deploy: DeployConfig) -> list[dict]:
    """EC2's layout for EFA on multi-card instances: the primary ENA on card 0, then one EFA-only
    interface per network card (device 1 on card 0, device 0 on the others)."""
    out = [{"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"},
           {"networkCardIndex": 0, "deviceIndex": 1, "interfaceType": "efa-only"}]
    out += [{"networkCardIndex": card, "deviceIndex": 0, "interfaceType": "efa-only"}
            for card in range(1, deploy.efa_interfaces)]
    return out


def ec2_node_class(deploy: DeployConfig) -> dict:
    selector = [{"tags": {DISCOVERY_TAG: deploy.cluster}}]
    spec = {
        "role": node_role(deploy),
        # pinned: a new AMI is a drift, not a surprise
        "amiSelectorTerms": [{"alias": deploy.ami_alias}],
        "subnetSelectorTerms": selector,
        "securityGroupSelectorTerms": selector,
        "instanceStorePolicy": "RAID0",  # local NVMe as one volume for images and emptyDirs
        "blockDeviceMappings": [
            {
                "deviceName": "/dev/xvda",
                "rootVolume": True,
                "ebs": {
                    "volumeSize": deploy.root_volume_size,
                    "volumeType": "gp3",
                    "encrypted": True,
                    "deleteOnTermination": True,
                },
            }
        ],
    }
    if deploy.efa:
        spec["networkInterfaces"] = network_interfaces(deploy)
    return {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass",
            "metadata": metadata(deploy, deploy.node_class, namespaced=False), "spec": spec}
