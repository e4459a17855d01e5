"""`preftune render`: the objects, what each must hold, and that every one validates."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from preftune.cli import command as cli
from preftune.deploy.manifests import CONFIG_DIR, CONFIG_FILE, launch_command
from preftune.deploy.validate import admission_problems, schema_problems
from tests.deploy.conftest import render

# every deploy option, each in at least one rendering
OPTION_SETS = [
    [],
    ["deploy.scheduler=kubernetes"],
    ["deploy.nodes=1"],
    ["deploy.nodes=5", "deploy.gpus_per_node=4", "deploy.instance_types=[p5.48xlarge, p5e.48xlarge]"],
    ["deploy.capacity_type=on-demand", "deploy.efa=false", "deploy.zones=[us-east-2a, us-east-2b]"],
    ["deploy.scheduler=kubernetes", "deploy.efa=false", "deploy.nodes=2", "deploy.service_account=trainer"],
    ["deploy.checkpoint_claim=null", "checkpoint_uri=s3://bucket/ckpt", "deploy.env={NCCL_DEBUG: INFO, NCCL_MIN_NCHANNELS: 16}"],
    ["deploy.scheduler=kubernetes", "deploy.env={WANDB_API_KEY: {secret: wandb, key: api-key}, NCCL_DEBUG: WARN}"],
    ["deploy.env={HF_TOKEN: {secret: hf.tokens, key: read_token}, AWS_SECRET_ACCESS_KEY: {secret: aws, key: sk}}"],
    ["deploy.name=grpo-glm5", "deploy.namespace=ml", "deploy.queue=gpu-queue", "deploy.labels={team: rl}",
     "deploy.image=123.dkr.ecr.us-east-2.amazonaws.com/preftune:0.1.0", "deploy.image_pull_policy=Always"],
    ["deploy.storage_class=fsx-sc", "deploy.storage_size=2400Gi", "deploy.checkpoint_mount=/ckpt",
     "deploy.cpu=96", "deploy.memory=1000Gi", "deploy.shm_size=64Gi", "deploy.efa_interfaces=32"],
    ["deploy.max_retry=10", "deploy.termination_grace_seconds=110", "preemption_grace_seconds=90",
     "deploy.max_gpus=64", "deploy.expire_after=Never", "deploy.consolidate_after=30s"],
    ["deploy.node_pool=p5-spot", "deploy.node_class=p5-class", "deploy.cluster=prod", "deploy.node_role=MyNodeRole",
     "deploy.ami_alias=al2023@v20251001", "deploy.root_volume_size=500Gi"],
]


@pytest.mark.parametrize("overrides", OPTION_SETS, ids=lambda o: " ".join(o) or "defaults")
def test_every_rendering_validates(job_config, crd_dir, overrides):
    _, objects, _ = render(job_config, *overrides)
    assert admission_problems(objects) == []
    problems, unchecked = schema_problems(objects, crd_dir)
    assert problems == []
    # only the Volcano Queue lacks an upstream CRD in shared/k8s-crds
    assert all("Queue" in n for n in unchecked)


def _pod(objects):
    job = objects["7-job.yaml"]
    if job["apiVersion"] == "batch/v1":
        return job["spec"]["template"]["spec"]
    return job["spec"]["tasks"][0]["template"]["spec"]


def test_volcano_job_is_the_seed_job(job_config):
    cfg, objects, _ = render(job_config)
    assert set(objects) == {"5-configmap.yaml", "3-queue.yaml", "7-job.yaml", "4-pvc.yaml", "2-nodepool.yaml",
                            "1-ec2nodeclass.yaml"}
    job = objects["7-job.yaml"]
    spec = job["spec"]
    assert (job["apiVersion"], spec["schedulerName"], spec["queue"]) == ("batch.volcano.sh/v1alpha1", "volcano",
                                                                         "training-queue")
    assert [(t["name"], t["replicas"]) for t in spec["tasks"]] == [("master", 1), ("worker", 2)]
    assert spec["minAvailable"] == 3 == sum(t["replicas"] for t in spec["tasks"])  # gang: all or nothing
    assert spec["policies"] == [{"exitCode": 78, "action": "AbortJob"}, {"exitCode": 75, "action": "RestartJob"},
                                {"event": "PodEvicted", "action": "RestartJob"},
                                {"event": "PodFailed", "action": "RestartJob"}]
    assert spec["maxRetry"] >= 50
    assert set(spec["plugins"]) == {"pytorch", "svc"}
    for task in spec["tasks"]:
        pod = task["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["terminationGracePeriodSeconds"] > cfg.preemption_grace_seconds
        (c,) = pod["containers"]
        assert c["command"] == launch_command() == ["preftune", "launch", f"{CONFIG_DIR}/{CONFIG_FILE}"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
        assert {"name": "FI_PROVIDER", "value": "efa"} in c["env"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "preftune-checkpoints"
        assert volumes["config"]["configMap"]["name"] == objects["5-configmap.yaml"]["metadata"]["name"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"config": CONFIG_DIR, "dshm": "/dev/shm", "checkpoints": "/checkpoints"}
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        exprs = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
        assert exprs == {"node.kubernetes.io/instance-type": ["p5en.48xlarge"], "karpenter.sh/capacity-type": ["spot"]}
    pvc = objects["4-pvc.yaml"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_no_do_not_disrupt_annotation_anywhere(job_config):
    for overrides in OPTION_SETS:
        _, objects, _ = render(job_config, *overrides)
        assert "do-not-disrupt" not in yaml.safe_dump(list(objects.values()))


def test_configmap_holds_the_config_as_written_with_output_dir_on_the_claim(job_config):
    from preftune.config import Config, from_dict

    _, objects, _ = render(job_config, "grpo.beta=0.04")
    written = yaml.safe_load(objects["5-configmap.yaml"]["data"][CONFIG_FILE])
    assert written["output_dir"] == "/checkpoints/runs/seed-job"
    assert written["grpo"] == {"beta": 0.04}
    assert written["data"]["train"] == "s3://bucket/prompts/"
    assert from_dict(Config, written).grpo.beta == 0.04  # a config launch can load
    _, objects, _ = render(job_config, "deploy.checkpoint_claim=null", "checkpoint_uri=s3://b/c")
    assert yaml.safe_load(objects["5-configmap.yaml"]["data"][CONFIG_FILE])["output_dir"] == "runs/seed-job"
    assert "4-pvc.yaml" not in objects


def test_kubernetes_scheduler_renders_an_indexed_job_and_headless_service(job_config):
    _, objects, _ = render(job_config, "deploy.scheduler=kubernetes")
    assert "3-queue.yaml" not in objects
    job, svc = objects["7-job.yaml"], objects["6-service.yaml"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [78]}} in rules
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"]["value"] == "preftune-0.preftune" and env["WORLD_SIZE"]["value"] == "3"
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_node_pool_matches_the_pods(job_config):
    _, objects, _ = render(job_config, "deploy.zones=[us-east-2a]")
    pool, nodeclass, pod = objects["2-nodepool.yaml"], objects["1-ec2nodeclass.yaml"], _pod(objects)
    tmpl = pool["spec"]["template"]["spec"]
    for taint in tmpl["taints"]:  # every taint is tolerated by the training pods
        assert any(t["key"] == taint["key"] and (t["operator"] == "Exists" or t["value"] == taint.get("value"))
                   for t in pod["tolerations"])
    reqs = {r["key"]: r["values"] for r in tmpl["requirements"]}
    assert reqs == {"karpenter.sh/capacity-type": ["spot"], "node.kubernetes.io/instance-type": ["p5en.48xlarge"],
                    "topology.kubernetes.io/zone": ["us-east-2a"]}
    disruption = pool["spec"]["disruption"]
    assert disruption["consolidationPolicy"] == "WhenEmpty"
    assert {"nodes": "0", "reasons": ["Underutilized", "Drifted"]} in disruption["budgets"]
    assert pool["spec"]["limits"]["nvidia.com/gpu"] == 32  # one spare node for a spot replacement
    assert tmpl["nodeClassRef"]["name"] == nodeclass["metadata"]["name"]
    ncs = nodeclass["spec"]
    assert ncs["amiSelectorTerms"] == [{"alias": "al2023@v20260807"}] and ncs["instanceStorePolicy"] == "RAID0"
    assert len(ncs["networkInterfaces"]) == 17  # the primary ENA + 16 EFA
    assert ncs["role"] == "KarpenterNodeRole-training-cluster"
    _, objects, _ = render(job_config, "deploy.efa=false", "deploy.capacity_type=on-demand")
    assert "networkInterfaces" not in objects["1-ec2nodeclass.yaml"]["spec"]
    assert "vpc.amazonaws.com/efa" not in _pod(objects)["containers"][0]["resources"]["limits"]
    assert [t["key"] for t in objects["2-nodepool.yaml"]["spec"]["template"]["spec"]["taints"]] == ["nvidia.com/gpu"]


@pytest.mark.parametrize("override, key", [
    ("deploy.nodes=0", "deploy.nodes"),
    ("deploy.capacity_type=preemptible", "deploy.capacity_type"),
    ("deploy.termination_grace_seconds=30", "deploy.termination_grace_seconds"),
    ("deploy.scheduler=slurm", "deploy.scheduler"),
    ("deploy.name=GRPO_Job", "deploy.name"),
    ("deploy.checkpoint_claim=null", "deploy.checkpoint_claim"),
    ("deploy.env={'bad name': x}", "deploy.env.bad name"),
    ("deploy.env={TOKEN: {secret: Bad_Name, key: k}}", "deploy.env.TOKEN"),
    ("deploy.env={TOKEN: {secret: s}}", "deploy.env.TOKEN"),
    ("data.train=https://me:hunter2@data.example.com/t.jsonl", "data.train"),
    ("deploy.max_gpus=8", "deploy.max_gpus"),
    ("deploy.memory=lots", "deploy.memory"),
    ("deploy.expire_after=1w", "deploy.expire_after"),
    ("deploy.gpu_per_node=8", "deploy.gpus_per_node"),
    ("deploy.instance_types=[]", "deploy.instance_types"),
    ("deploy.ami_alias=ubuntu@22.04", "deploy.ami_alias"),
])
def test_bad_deploy_option_is_exit_78_naming_the_key_and_writes_nothing(job_config, tmp_path, capsys, override, key):
    out = tmp_path / "manifests"
    assert cli.main(["render", str(job_config), "-o", str(out), override]) == 78
    err = capsys.readouterr().err.strip()
    assert key in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_render_writes_files_and_prints_the_cost(job_config, tmp_path, capsys):
    out = tmp_path / "m"
    assert cli.main(["render", str(job_config), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(["5-configmap.yaml", "3-queue.yaml", "7-job.yaml", "4-pvc.yaml",
                                                            "2-nodepool.yaml", "1-ec2nodeclass.yaml"])
    assert "24 GPUs x $10-15 per GPU-hour (spot) = $240-360 per hour" in text
    assert yaml.safe_load((out / "7-job.yaml").read_text())["kind"] == "Job"
    for path in out.iterdir():  # plain YAML: no anchors or aliases, and it reads back as rendered
        text = path.read_text()
        assert "&id" not in text and "*id" not in text
    assert "config.yaml: |" in (out / "5-configmap.yaml").read_text()
    _, objects, _ = render(job_config)
    assert {p.name: yaml.safe_load(p.read_text()) for p in out.iterdir()} == objects


def test_render_prints_the_estimate_of_the_job_and_a_bad_flag_writes_nothing(job_config, tmp_path, capsys):
    out = tmp_path / "m"
    assert cli.main(["render", str(job_config), "-o", str(out), "--hours", "4-6", "deploy.nodes=2"]) == 0
    text = capsys.readouterr().out
    assert "16 GPUs (2 x 8, spot p5en.48xlarge) x 4-6 hours" in text and "compute:        $640-1,440" in text
    bad = tmp_path / "bad"
    assert cli.main(["render", str(job_config), "-o", str(bad), "--hours", "6-4"]) == 78
    assert "--hours" in capsys.readouterr().err and not bad.exists()


def test_render_check_with_and_without_crds(job_config, crd_dir, capsys):
    assert cli.main(["render", str(job_config), "--check", "--crd-dir", str(crd_dir)]) == 0
    assert "checked 5 of 6 objects against their schemas: ok" in capsys.readouterr().out
    assert cli.main(["render", str(job_config), "--check"]) == 0
    assert "pass --crd-dir" in capsys.readouterr().out
    assert cli.main(["render", str(job_config)]) == 78  # neither -o nor --check


def test_notes_name_paths_the_container_must_have(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {train: data/prompts.jsonl}\npreemption_grace_seconds: 100\ncheckpoint_uri: s3://b/c\n"
                   "grpo: {reward_funcs: [accuracy, my_rewards.py:brevity]}\n")
    _, _, notes = render(cfg)
    text = "\n".join(notes)
    assert "grpo.reward_funcs 'my_rewards.py:brevity'" in text and "accuracy" not in text
    assert "data.train 'data/prompts.jsonl'" in text and "model.name_or_path 'examples/model'" in text
    assert "spot notice" in text


def test_deploy_modules_do_not_import_torch(job_config, tmp_path):
    code = ("import sys; from preftune.cli import command as cli; "
            f"rc = cli.main(['render', {str(job_config)!r}, '-o', {str(tmp_path / 'o')!r}, '--check']); "
            "rc2 = cli.main(['cost', '--hours', '4', '--json']); "
            "import preftune.deploy.cost, preftune.deploy.validate, preftune.deploy.nodes; "
            "assert rc == rc2 == 0, (rc, rc2); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


def test_the_option_sets_cover_every_deploy_key():
    from dataclasses import fields

    from preftune.config import DeployConfig

    set_keys = {o.split("=")[0].split(".")[1] for opts in OPTION_SETS for o in opts if o.startswith("deploy.")}
    assert {f.name for f in fields(DeployConfig)} - set_keys == set()


def test_files_sort_in_apply_order(job_config):
    for overrides in ([], ["deploy.scheduler=kubernetes"]):
        _, objects, _ = render(job_config, *overrides)
        kinds = [objects[f]["kind"] for f in sorted(objects)]
        assert kinds.index("Job") == len(kinds) - 1  # the job last: its queue, claim and config exist first
        assert kinds.index("EC2NodeClass") < kinds.index("NodePool")
        if "Queue" in kinds:
            assert kinds.index("Queue") < kinds.index("Job")


def test_a_failed_check_writes_nothing(job_config, crd_dir, tmp_path, capsys):
    crds = tmp_path / "crds"
    crds.mkdir()
    for path in crd_dir.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if doc["spec"]["names"]["kind"] == "Job":  # a cluster whose Volcano caps maxRetry at 5
            doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["maxRetry"][
                "maximum"] = 5
        (crds / path.name).write_text(yaml.safe_dump(doc))
    out = tmp_path / "m"
    assert cli.main(["render", str(job_config), "-o", str(out), "--check", "--crd-dir", str(crds)]) == 78
    err = capsys.readouterr().err
    assert "7-job.yaml: Job preftune: spec.maxRetry: 100 is greater than the maximum of 5" in err
    assert not out.exists()
    assert cli.main(["render", str(job_config), "-o", str(out), "--check", "--crd-dir", str(crds),
                     "deploy.max_retry=5"]) == 0


def test_secrets_by_reference_and_no_credential_in_the_configmap(job_config):
    _, objects, notes = render(job_config, "deploy.env={WANDB_API_KEY: {secret: wandb, key: api-key}, "
                                           "HF_TOKEN: hf_plainTextToken123, NCCL_DEBUG: INFO}")
    env = {e["name"]: e for e in _pod(objects)["containers"][0]["env"]}
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY",
                                    "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
    text = objects["5-configmap.yaml"]["data"][CONFIG_FILE]
    assert "hf_plainTextToken123" not in text and "<redacted>" in text
    assert yaml.safe_load(text)["deploy"]["env"]["WANDB_API_KEY"] == {"secret": "wandb", "key": "api-key"}
    assert any("deploy.env.HF_TOKEN looks like a credential" in n for n in notes)


def test_a_vllm_job_runs_its_engine_in_process_and_says_what_it_takes(job_config):
    """Rendering needs no vLLM here (the image has it); the pods get the in-process engine setting,
    and the notes say the engine's share of each GPU."""
    _, objects, notes = render(job_config, "grpo.use_vllm=true", "grpo.vllm_gpu_memory_utilization=0.35")
    for task in objects["7-job.yaml"]["spec"]["tasks"]:
        env = {e["name"]: e.get("value") for e in task["template"]["spec"]["containers"][0]["env"]}
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert any("grpo.use_vllm" in n and "0.35" in n for n in notes)
    _, plain, _ = render(job_config)
    env = plain["7-job.yaml"]["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["env"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in {e["name"] for e in env}
