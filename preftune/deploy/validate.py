"""Check rendered objects as the API server would: schemas, then the rules its webhooks enforce.

- `admission_problems` (pure Python, always run by `render`): the Volcano admission webhook's
  rules for Jobs and Queues, Kubernetes' rules for Job pod-failure policies, and the CEL rules of
  the Karpenter CRDs that the rendered fields touch.
- `schema_problems` (needs the `deploy` extra): core kinds against the Kubernetes OpenAPI schemas
  (kubernetes-validate, strict: unknown fields are errors) and custom resources against their
  CRD's openAPIV3Schema (jsonschema), with unknown fields made errors too, as `kubectl apply`'s
  strict field validation does. CRDs are read from a folder (`kubectl get crd NAME -o yaml`).
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from preftune.config.deploy import DNS_LABEL, EC2_ALIAS_FAMILIES
from preftune.errors import UserError

KUBE_VERSION = "1.33"
VOLCANO_EVENTS = {"*", "PodFailed", "PodEvicted", "PodPending", "Unknown", "TaskCompleted",
                  "TaskFailed", "JobUpdated"}
VOLCANO_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod",
                   "RestartPartition", "TerminateJob", "CompleteJob", "ResumeJob"}
VOLCANO_PLUGINS = {"ssh", "env", "svc", "tensorflow", "mpi", "pytorch", "hcclrank", "ray"}


def _name(obj: dict) -> str:
    return f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"


# ---------------------------------------------------------------- admission rules


def volcano_policy_problems(policies: list[dict]) -> list[str]:
    """Volcano's validatePolicies: event xor exitCode, no exit code 0, nothing twice, '*' alone."""
    out, events, codes = [], set(), set()
    for p in policies:
        has_event = bool(p.get("event") or p.get("events"))
        if has_event and p.get("exitCode") is not None:
            out.append(f"policy {p} has both event and exitCode")
        elif not has_event and p.get("exitCode") is None:
            out.append(f"policy {p} has neither event nor exitCode")
        elif has_event:
            for event in set(p.get("events", [])) | ({p["event"]} if p.get("event") else set()):
                if event not in VOLCANO_EVENTS:
                    out.append(f"policy event {event!r} is not allowed")
                elif event in events:
                    out.append(f"duplicate policy event {event}")
                events.add(event)
        elif p["exitCode"] == 0:
            out.append("exit code 0 is not a valid policy exit code")
        elif p["exitCode"] in codes:
            out.append(f"duplicate policy exitCode {p['exitCode']}")
        else:
            codes.add(p["exitCode"])
        if p.get("action") not in VOLCANO_ACTIONS:
            out.append(f"policy action {p.get('action')!r} is not allowed")
    if "*" in events and len(events) > 1:
        out.append("a '*' policy must be the only event policy")
    return out


def volcano_job_problems(job: dict, queues: set[str] | None = None) -> list[str]:
    spec, name = job.get("spec", {}), job["metadata"]["name"]
    tasks = spec.get("tasks") or []
    out = [] if tasks else ["no task"]
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        if task.get("name") in seen:
            out.append(f"duplicate task name {task.get('name')}")
        seen.add(task.get("name"))
        if task.get("minAvailable", 0) > task.get("replicas", 0):
            out.append(f"task {task.get('name')}: minAvailable above replicas")
        out += [
            f"task {task.get('name')}: {p}"
            for p in volcano_policy_problems(task.get("policies", []))
        ]
        # the longest pod name
        pod = f"{name}-{task.get('name')}-{max(task.get('replicas', 1) - 1, 0)}"
        if len(pod) > 63:
            out.append(f"pod name {pod} is longer than 63 characters")
        if task.get("template", {}).get("spec", {}).get("restartPolicy") not in (
            None,
            "Never",
            "OnFailure",
        ):
            out.append(f"task {task.get('name')}: restartPolicy must be Never or OnFailure")
    if spec.get("minAvailable", 0) > sum(t.get("replicas", 0) for t in tasks):
        out.append(f"minAvailable {spec.get('minAvailable')} is above the total replicas")
    out += volcano_policy_problems(spec.get("policies", []))
    out += [f"unknown job plugin {p}" for p in spec.get("plugins", {}) if p not in VOLCANO_PLUGINS]
    if "pytorch" in spec.get("plugins", {}):
        master = next(
            (a.split("=", 1)[1] for a in spec["plugins"]["pytorch"] if a.startswith("--master=")),
            "master",
        )
        if master not in seen:
            out.append(f"the pytorch plugin's master task {master!r} is missing")
    if queues is not None and spec.get("queue", "default") not in queues:
        out.append(f"queue {spec.get('queue')!r} is not among the rendered queues")
    return out


def volcano_queue_problems(queue: dict) -> list[str]:
    spec = queue.get("spec", {})
    out = []
    if not isinstance(spec.get("weight", 1), int) or spec.get("weight", 1) < 1:
        out.append(f"weight must be a positive integer, got {spec.get('weight')!r}")
    if queue.get("status", {}).get("state", "Open") not in ("Open", "Closed"):
        out.append("state must be Open or Closed")
    if queue.get("status", {}).get("state", "Open") == "Closed":
        out.append("a closed queue refuses new jobs")
    return out


def batch_job_problems(job: dict) -> list[str]:
    spec = job.get("spec", {})
    out = []
    rules = spec.get("podFailurePolicy", {}).get("rules", [])
    if rules and spec.get("template", {}).get("spec", {}).get("restartPolicy") != "Never":
        out.append("podFailurePolicy needs restartPolicy Never")
    for rule in rules:
        codes = rule.get("onExitCodes", {}).get("values", [])
        if rule.get("onExitCodes", {}).get("operator") == "In" and 0 in codes:
            out.append("podFailurePolicy onExitCodes In must not contain 0")
        if codes != sorted(set(codes)):
            out.append("podFailurePolicy exit codes must be unique and ascending")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            out.append("each podFailurePolicy rule needs exactly "
                       "one of onExitCodes, onPodConditions")
    if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
        out.append("an Indexed Job needs completions")
    return out


def ec2_node_class_problems(nc: dict) -> list[str]:
    """The CEL rules of the EC2NodeClass CRD on the fields preftune renders."""
    spec, out = nc.get("spec", {}), []
    if ("role" in spec) == ("instanceProfile" in spec):
        out.append("exactly one of role, instanceProfile")
    for term in spec.get("amiSelectorTerms", []):
        alias = term.get("alias")
        if alias is not None and (
            "@" not in alias or alias.split("@")[0] not in EC2_ALIAS_FAMILIES
        ):
            out.append(f"AMI alias {alias!r} is not family@version of a supported family")
    nics = spec.get("networkInterfaces", [])
    pairs = [(n["networkCardIndex"], n["deviceIndex"]) for n in nics]
    if nics and (0, 0, "interface") not in {(c, d, n["interfaceType"]) for (c, d),
                                            n in zip(pairs, nics)}:
        out.append("networkInterfaces must include the primary "
                   "interface (card 0, device 0, interface)")
    if len(set(pairs)) != len(pairs):
        out.append("networkInterfaces repeat a (networkCardIndex, deviceIndex) pair")
    efa_cards = [n["networkCardIndex"] for n in nics if n["interfaceType"] == "efa-only"]
    if len(set(efa_cards)) != len(efa_cards):
        out.append("at most one EFA-only interface per network card")
    roots = [b for b in spec.get("blockDeviceMappings", []) if b.get("rootVolume")]
    if len(roots) > 1:
        out.append("only one root volume")
    return out


def node_pool_problems(pool: dict) -> list[str]:
    spec, out = pool.get("spec", {}), []
    for budget in spec.get("disruption", {}).get("budgets", []):
        if ("schedule" in budget) != ("duration" in budget):
            out.append("a disruption budget's schedule must come with a duration")
    for req in spec.get("template", {}).get("spec", {}).get("requirements", []):
        key = req.get("key", "")
        if key in ("karpenter.sh/nodepool", "kubernetes.io/hostname") or (
                key.split("/")[0].endswith("karpenter.sh") and key != "karpenter.sh/capacity-type"):
            out.append(f"requirement key {key} is restricted")
        if req.get("operator") == "In" and not req.get("values"):
            out.append(f"requirement {key} In needs values")
    return out


def metadata_problems(obj: dict, cluster_scoped: bool) -> list[str]:
    meta, out = obj.get("metadata", {}), []
    name = meta.get("name") or ""
    limit = 63 if obj.get("kind") in ("Service", "Job") else 253
    if not all(DNS_LABEL.match(part) for part in name.split(".")) or len(name) > limit:
        out.append(f"name {name!r} is not a valid Kubernetes name")
    if cluster_scoped == ("namespace" in meta):
        out.append("namespace set on a cluster-scoped object" if cluster_scoped else "no namespace")
    if "karpenter.sh/do-not-disrupt" in meta.get("annotations", {}):
        out.append("karpenter.sh/do-not-disrupt would hold back the SIGTERM that lets the run save")
    return out


CLUSTER_SCOPED = {"Queue", "NodePool", "EC2NodeClass"}
RULES = {("batch.volcano.sh/v1alpha1", "Job"): None,  # needs the queue list: see admission_problems
         ("scheduling.volcano.sh/v1beta1", "Queue"): volcano_queue_problems,
         ("batch/v1", "Job"): batch_job_problems,
         ("karpenter.k8s.aws/v1", "EC2NodeClass"): ec2_node_class_problems,
         ("karpenter.sh/v1", "NodePool"): node_pool_problems}


def admission_problems(objects: dict[str, dict]) -> list[str]:
    """'file: Kind name: problem' for every rule the rendered set breaks (file -> object)."""
    queues = {o["metadata"]["name"] for o in objects.values() if o.get("kind") == "Queue"}
    out = []
    for fname, obj in objects.items():
        problems = metadata_problems(obj, obj.get("kind") in CLUSTER_SCOPED)
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key == ("batch.volcano.sh/v1alpha1", "Job"):
            problems += volcano_job_problems(obj, queues)
        elif key in RULES:
            problems += RULES[key](obj)
        out += [f"{fname}: {_name(obj)}: {p}" for p in problems]
    return out


# ---------------------------------------------------------------- schemas


def load_crds(crd_dir: str | Path) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema for every CRD in the YAML files of a folder."""
    folder = Path(crd_dir)
    if not folder.is_dir():
        raise UserError("not a folder of CRD YAML files", where=str(crd_dir))
    schemas = {}
    for path in sorted(folder.glob("*.y*ml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        # kubectl get -o yaml
        docs += [item for d in docs if d.get("kind") == "List" for item in d.get("items", [])]
        for doc in docs:
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def strict_schema(schema: dict) -> dict:
    """A copy that refuses unknown fields wherever the API server would prune them."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


@functools.lru_cache(maxsize=4)
def _strict_crds(crd_dir: str) -> dict[tuple[str, str], dict]:
    return {key: strict_schema(schema) for key, schema in load_crds(crd_dir).items()}


def _schema_errors(validator_cls, schema: dict, obj: dict) -> list[str]:
    validator = validator_cls(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in sorted(validator.iter_errors(obj),
                            key=lambda e: list(map(str, e.absolute_path)))]


def schema_problems(objects: dict[str, dict],
                    crd_dir: str | Path | None) -> tuple[list[str], list[str]]:
    """(problems, notes): schema errors per object, and which objects had no schema to check."""
    try:
        import jsonschema
        import kubernetes_validate
    except ImportError:
        raise UserError("--check needs kubernetes-validate and "
                        "jsonschema: pip install 'preftune[deploy]'") from None
    crds = _strict_crds(str(Path(crd_dir).resolve())) if crd_dir else {}
    problems, notes = [], []
    for fname, obj in objects.items():
        where = f"{fname}: {_name(obj)}"
        key = (obj["apiVersion"], obj["kind"])
        # the core and built-in groups (v1, batch/v1)
        if "." not in obj["apiVersion"].split("/")[0]:
            try:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where}: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}")
        elif key in crds:
            problems += [
                f"{where}: {m}" for m in _schema_errors(jsonschema.Draft7Validator, crds[key], obj)
            ]
        else:
            notes.append(
                f"{where}: no CRD for {obj['apiVersion']} {obj['kind']}"
                + (f" in {crd_dir}" if crd_dir else " (pass --crd-dir)")
                + "; schema not checked"
            )
        if key == ("batch.volcano.sh/v1alpha1", "Job"):  # each task's pod as a core PodTemplate
            for task in obj["spec"].get("tasks", []):
                pod = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": task["name"]}, "template": task["template"]}
                try:
                    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    problems.append(f"{where}: task {task['name']}: "
                                    f"{'.'.join(map(str, e.path))}: {e.message}")
    return problems, notes
