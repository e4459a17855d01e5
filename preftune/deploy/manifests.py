"""Kubernetes objects for one training job, as plain dicts (one YAML file each).

The pod runs `preftune launch CONFIG` with the config from a ConfigMap; the job's restart policy
turns the exit codes into actions: 78 (config or data error) aborts, 75 (preempted, checkpoint
saved) and lost or evicted pods restart the whole job, which resumes from the shared checkpoint.
"""
from __future__ import annotations

from pathlib import PurePosixPath

import yaml

from preftune.config import DeployConfig
from preftune.config.redact import is_reference, redact
from preftune.deploy.settings import termination_grace
from preftune.errors import EXIT_PREEMPTED, EXIT_USER

ENTRYPOINT = ["preftune"]  # the image's ENTRYPOINT (Dockerfile)
CONFIG_DIR = "/etc/preftune"
CONFIG_FILE = "config.yaml"
CONTAINER = "trainer"
MASTER_PORT = 23456  # Volcano's pytorch plugin default
GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
CAPACITY_TYPE = "karpenter.sh/capacity-type"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
ZONE = "topology.kubernetes.io/zone"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# libfabric over EFA with GPUDirect RDMA
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def launch_command() -> list[str]:
    return [*ENTRYPOINT, "launch", f"{CONFIG_DIR}/{CONFIG_FILE}"]


def metadata(deploy: DeployConfig, name: str, *, namespaced: bool = True) -> dict:
    labels = {"app.kubernetes.io/name": "preftune",
              "app.kubernetes.io/instance": deploy.name, **deploy.labels}
    return {"name": name,
            **({"namespace": deploy.namespace} if namespaced else {}), "labels": labels}


def pod_config(data: dict, deploy: DeployConfig) -> dict:
    """The config the pods train with: the user's, with a relative output_dir moved onto the claim
    (a pod's own disk is lost with its node)."""
    data = {**data}
    out = str(data.get("output_dir", "runs/preftune"))
    if deploy.checkpoint_claim and "://" not in out and not PurePosixPath(out).is_absolute():
        data["output_dir"] = str(PurePosixPath(deploy.checkpoint_mount) / out)
    return data


def config_map(deploy: DeployConfig, data: dict) -> dict:
    """The config as written, credentials redacted: a ConfigMap is not a secret (the pods take
    deploy.env from the Job, and render refuses credentials anywhere else in the config)."""
    data = redact(data)
    text = yaml.safe_dump(pod_config(data, deploy), sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(deploy, f"{deploy.name}-config"), "data": {CONFIG_FILE: text}}


def _env(deploy: DeployConfig) -> list[dict]:
    """deploy.env; a {secret, key} entry becomes a secretKeyRef (the pod reads the Secret)."""
    env = {**(EFA_ENV if deploy.efa else {}), **deploy.env}
    return [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": v["secret"], "key": v["key"]}}}
        if is_reference(v)
        else {"name": k, "value": str(v)}
        for k, v in env.items()
    ]


def _node_affinity(deploy: DeployConfig) -> dict:
    terms = [{"key": INSTANCE_TYPE, "operator": "In", "values": list(deploy.instance_types)},
             {"key": CAPACITY_TYPE, "operator": "In", "values": [deploy.capacity_type]}]
    if deploy.zones:
        terms.append({"key": ZONE, "operator": "In", "values": list(deploy.zones)})
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": terms}]}}}


def tolerations(deploy: DeployConfig) -> list[dict]:
    """Tolerate the taints the NodePool puts on its nodes (so only training pods land there)."""
    out = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    if deploy.capacity_type == "spot":
        out.append({"key": CAPACITY_TYPE, "operator": "Equal", "value": "spot",
                    "effect": "NoSchedule"})
    return out


def taints(deploy: DeployConfig) -> list[dict]:
    out = [{"key": GPU, "effect": "NoSchedule"}]
    if deploy.capacity_type == "spot":
        out.append({"key": CAPACITY_TYPE, "value": "spot", "effect": "NoSchedule"})
    return out


def _container(deploy: DeployConfig, extra_env: list[dict]) -> dict:
    limits = {GPU: deploy.gpus_per_node, "memory": deploy.memory}
    if deploy.efa:
        limits[EFA] = deploy.efa_interfaces
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if deploy.checkpoint_claim:
        mounts.append({"name": "checkpoints", "mountPath": deploy.checkpoint_mount})
    return {"name": CONTAINER, "image": deploy.image, "imagePullPolicy": deploy.image_pull_policy,
            "command": launch_command(), "env": _env(deploy) + extra_env,
            "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT}],
            "resources": {"requests": {"cpu": deploy.cpu, **limits}, "limits": limits},
            "volumeMounts": mounts}


def pod_template(deploy: DeployConfig, grace_seconds: float, extra_env: list[dict] = (),
                 extra_spec: dict | None = None) -> dict:
    volumes = [{"name": "config", "configMap": {"name": f"{deploy.name}-config"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": deploy.shm_size}}]
    if deploy.checkpoint_claim:
        volumes.append({"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": deploy.checkpoint_claim}})
    # the job's policy restarts everything; a lone rank cannot rejoin
    spec = {"restartPolicy": "Never",
            "terminationGracePeriodSeconds": termination_grace(deploy, grace_seconds),
            "affinity": _node_affinity(deploy), "tolerations": tolerations(deploy),
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                "runAsGroup": 1000, "fsGroup": 1000},
            "containers": [_container(deploy, list(extra_env))],
            "volumes": volumes, **(extra_spec or {})}
    if deploy.service_account:
        spec["serviceAccountName"] = deploy.service_account
    return {"metadata": {"labels": metadata(deploy, "")["labels"]}, "spec": spec}


# Volcano matches policies in order, first match wins: a config error must not become a restart.
VOLCANO_POLICIES = [
    {"exitCode": EXIT_USER, "action": "AbortJob"},
    {"exitCode": EXIT_PREEMPTED, "action": "RestartJob"},
    {"event": "PodEvicted", "action": "RestartJob"},
    {"event": "PodFailed", "action": "RestartJob"},
]


def volcano_job(deploy: DeployConfig, grace_seconds: float) -> dict:
    """A gang-scheduled vcjob: no pod starts until every node has a place (minAvailable = all)."""
    tasks = [{"name": "master", "replicas": 1, "template": pod_template(deploy, grace_seconds)}]
    if deploy.nodes > 1:
        tasks.append({"name": "worker", "replicas": deploy.nodes - 1,
                      "template": pod_template(deploy, grace_seconds)})
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
            "metadata": metadata(deploy, deploy.name),
            "spec": {"schedulerName": "volcano", "queue": deploy.queue,
                     "minAvailable": deploy.nodes, "maxRetry": deploy.max_retry,
                     # pytorch: MASTER_ADDR/PORT, WORLD_SIZE (pods) and RANK (pod index); svc: the
                     # pods' DNS
                     "plugins": {"pytorch": ["--master=master", "--worker=worker",
                                             f"--port={MASTER_PORT}"],
                                 "svc": []},
                     "policies": [dict(p) for p in VOLCANO_POLICIES], "tasks": tasks}}


def indexed_job(deploy: DeployConfig, grace_seconds: float) -> dict:
    """Without Volcano: an Indexed Job, its pods found through a headless Service of the same name.
    Not gang-scheduled: pods start as nodes arrive and wait in the rendezvous."""
    env = [
        {"name": "MASTER_ADDR", "value": f"{deploy.name}-0.{deploy.name}"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "WORLD_SIZE", "value": str(deploy.nodes)},
        {
            "name": "RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}},
        },
    ]
    template = pod_template(deploy, grace_seconds, env, {"subdomain": deploy.name})
    def on_exit(code: int) -> dict:
        return {"containerName": CONTAINER, "operator": "In", "values": [code]}
    rules = [{"action": "FailJob", "onExitCodes": on_exit(EXIT_USER)},
             {"action": "Ignore", "onExitCodes": on_exit(EXIT_PREEMPTED)},
             {"action": "Ignore",
              "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(deploy, deploy.name),
            "spec": {"completionMode": "Indexed", "completions": deploy.nodes,
                     "parallelism": deploy.nodes,
                     "backoffLimit": deploy.max_retry, "podFailurePolicy": {"rules": rules},
                     "template": template}}


def headless_service(deploy: DeployConfig) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(deploy, deploy.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/instance": deploy.name},
                     "ports": [{"name": "rendezvous", "port": MASTER_PORT,
                                "targetPort": MASTER_PORT}]}}


def volcano_queue(deploy: DeployConfig) -> dict:
    # not reclaimable: another queue taking back a node would preempt the whole gang
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue",
            "metadata": metadata(deploy, deploy.queue, namespaced=False),
            "spec": {"weight": 1, "reclaimable": False}}


def checkpoint_claim(deploy: DeployConfig) -> dict:
    spec = {"accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": deploy.storage_size}}}
    if deploy.storage_class:
        spec["storageClassName"] = deploy.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": metadata(deploy, deploy.checkpoint_claim), "spec": spec}
