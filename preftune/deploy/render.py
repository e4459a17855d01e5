"""The set of objects `preftune render` writes, checked before anything is written."""
from __future__ import annotations

import dataclasses

from preftune.config.redact import credentials
from preftune.deploy import manifests, nodes
from preftune.deploy.settings import SPOT_NOTICE_SECONDS, termination_grace
from preftune.deploy.validate import admission_problems
from preftune.errors import UserError

LOCAL_PATH_KEYS = (("model", "name_or_path"), ("data", "train"), ("data", "eval"))


# a colocated engine runs in the training process (weights pass by reference), not in a subprocess
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def render_objects(cfg, data: dict, *,
                   memory: str | None = None) -> tuple[dict[str, dict], list[str]]:
    """(file name -> object, notes for the user). `cfg` is the checked config, `data` the config
    as written, which the pods get in the ConfigMap; `memory` the Pod's memory from the plan
    (default: deploy.memory)."""
    d = cfg.deploy
    if memory is not None:
        d = dataclasses.replace(d, memory=memory)
    if cfg.algorithm == "grpo" and cfg.grpo.use_vllm:  # the engine lives in the training process
        d = dataclasses.replace(d, env={**VLLM_ENV, **d.env})
    grace = cfg.preemption_grace_seconds
    leaks = [k for k in credentials(data) if not k.startswith("deploy.env.")]
    if leaks:  # the pods need these values, and a ConfigMap is not a secret
        raise UserError("holds a credential, which would be written to the "
                        "ConfigMap: give it to the pods as deploy.env: {NAME: "
                        "{secret: SECRET, key: KEY}} and read it from the environment",
                        where=leaks[0])
    # numbered in apply order (`kubectl apply -f DIR` goes by file name): Volcano refuses a job
    # whose queue does not exist yet
    objects = {"1-ec2nodeclass.yaml": nodes.ec2_node_class(d),
               "2-nodepool.yaml": nodes.node_pool(d)}
    if d.scheduler == "volcano":
        objects["3-queue.yaml"] = manifests.volcano_queue(d)
    if d.checkpoint_claim:
        objects["4-pvc.yaml"] = manifests.checkpoint_claim(d)
    objects["5-configmap.yaml"] = manifests.config_map(d, data)
    if d.scheduler == "volcano":
        objects["7-job.yaml"] = manifests.volcano_job(d, grace)
    else:
        objects["6-service.yaml"] = manifests.headless_service(d)
        objects["7-job.yaml"] = manifests.indexed_job(d, grace)
    problems = admission_problems(objects)
    if problems:  # a bug in preftune rather than in the config: the options were checked already
        raise UserError(f"rendered objects would be refused: {'; '.join(problems)}")
    return objects, container_notes(cfg, data)


def container_notes(cfg, data: dict) -> list[str]:
    """What the pods may not find: relative local paths resolve inside the image, not here."""
    notes, defaults = [], type(cfg)()
    for section, key in LOCAL_PATH_KEYS:
        value = (data.get(section) or {}).get(key, getattr(getattr(defaults, section), key))
        if value and "://" not in value and not value.startswith("/"):
            notes.append(f"{section}.{key} '{value}' is a relative local path: "
                         "the container resolves it in its working directory "
                         "(/app); bake it into the image or use s3://")
    for section in ("grpo", "eval"):
        for spec in (data.get(section) or {}).get("reward_funcs") or []:
            target = str(spec).rpartition(":")[0]
            if target.endswith(".py") and not target.startswith("/"):
                notes.append(f"{section}.reward_funcs '{spec}': the container "
                             f"needs {target} (bake it into the image)")
    for key in credentials({"env": dict(cfg.deploy.env)}):
        notes.append(f"deploy.{key} looks like a credential and is in the Job in plain text "
                     "(redacted in the "
                     "ConfigMap): give it as {secret: NAME, key: KEY}, a Kubernetes Secret's key")
    if cfg.algorithm == "grpo" and cfg.grpo.use_vllm:
        notes.append("grpo.use_vllm: each rank's engine takes "
                     f"{cfg.grpo.vllm_gpu_memory_utilization:g} of its GPU (weights + KV cache), "
                     "training the rest; the image needs vLLM (the Dockerfile installs the vllm "
                     "extra), and a restart pays the engine's start-up (docs/vllm.md)")
    grace = termination_grace(cfg.deploy, cfg.preemption_grace_seconds)
    if cfg.deploy.capacity_type == "spot" and grace > SPOT_NOTICE_SECONDS:
        notes.append(f"the pods' termination grace ({grace} s) exceeds EC2's {SPOT_NOTICE_SECONDS} "
                     "s spot notice: on spot, lower preemption_grace_seconds")
    return notes
