"""The checks of the `deploy:` section that its declarations cannot say: values that would render a
job Kubernetes refuses, or one that cannot save on preemption. UserError naming the key."""
from __future__ import annotations

import re

from preftune.config.schema import DeployConfig
from preftune.errors import UserError

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label, at most 63 characters
QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE])?$")
DURATION = re.compile(r"^(([0-9]+(s|m|h))+|Never)$")  # Karpenter's duration format
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# EC2NodeClass CEL
EC2_ALIAS_FAMILIES = ("al2", "al2023", "bottlerocket", "windows2019", "windows2022", "windows2025")


def check_deploy(deploy: DeployConfig, preemption_grace_seconds: float,
                 checkpoint_uri: str | None) -> None:
    """Raise UserError naming the first `deploy.*` key whose value cannot render a working job.
    Choices and numeric ranges are the fields' own, checked before this."""
    def bad(key: str, message: str) -> UserError:
        return UserError(message, where=f"deploy.{key}")

    if deploy.max_gpus is not None and deploy.max_gpus < deploy.nodes * deploy.gpus_per_node:
        raise bad(
            "max_gpus",
            f"{deploy.max_gpus} is below the job's {deploy.nodes * deploy.gpus_per_node} GPUs",
        )
    for key in ("name", "namespace", "queue", "node_pool", "node_class") + (
            ("checkpoint_claim",) if deploy.checkpoint_claim else ()):
        value = getattr(deploy, key)
        if not DNS_LABEL.match(value) or len(value) > 63:
            raise bad(key,
                      f"'{value}' is not a Kubernetes name "
                      "(lowercase letters, digits, '-'; at most 63)")
    # pod names (and hostnames) NAME-worker-INDEX must stay within 63 characters
    if len(deploy.name) > 40:
        raise bad("name", f"'{deploy.name}' is longer than 40 characters")
    for key in ("cpu", "memory", "shm_size", "storage_size", "root_volume_size"):
        if not QUANTITY.match(str(getattr(deploy, key))):
            raise bad(key,
                      f"'{getattr(deploy, key)}' is not a Kubernetes quantity (e.g. 160, 1600Gi)")
    for key in ("expire_after", "consolidate_after"):
        if not DURATION.match(getattr(deploy, key)):
            raise bad(key, f"'{getattr(deploy, key)}' is not a duration like 720h, 5m or Never")
    if not deploy.instance_types or not all(deploy.instance_types):
        raise bad("instance_types", "list at least one EC2 instance type")
    if not deploy.image:
        raise bad("image", "name the container image")
    if not deploy.checkpoint_mount.startswith("/"):
        raise bad("checkpoint_mount", f"'{deploy.checkpoint_mount}' is not an absolute path")
    if not re.match(r"^[a-zA-Z0-9]+@.+$",
                    deploy.ami_alias) or deploy.ami_alias.split("@")[0] not in EC2_ALIAS_FAMILIES:
        raise bad("ami_alias", f"'{deploy.ami_alias}' is not family@version with a family of "
                  f"{', '.join(EC2_ALIAS_FAMILIES)}")
    for env_key, value in deploy.env.items():
        if not ENV_NAME.match(env_key):
            raise bad(f"env.{env_key}", "not a valid environment variable name")
        if isinstance(value,
                      dict) and (set(value) != {"secret",
                                                "key"} or not DNS_SUBDOMAIN.match(value["secret"])
                                 or not SECRET_KEY.match(value["key"])):
            raise bad(f"env.{env_key}",
                      f"{value} is not a Secret reference {{secret: NAME, key: KEY}} (NAME a "
                      "Kubernetes name, KEY letters, digits, '-', '_', '.')")
    for key, value in deploy.labels.items():
        if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value) or len(value) > 63:
            raise bad(f"labels.{key}", f"'{key}: {value}' is not a valid Kubernetes label")
    if not deploy.checkpoint_claim and not checkpoint_uri:
        raise bad("checkpoint_claim",
                  "no checkpoint storage: name a ReadWriteMany claim or set checkpoint_uri, or a "
                  "restarted job starts over")
    grace = deploy.termination_grace_seconds
    if grace is not None and grace <= preemption_grace_seconds:
        raise bad("termination_grace_seconds",
                  f"{grace} s does not exceed preemption_grace_seconds "
                  f"({preemption_grace_seconds:g} s): the pod would be killed before the run saves")
