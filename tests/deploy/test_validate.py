"""The checks `render` and `render --check` run catch what the API server and its webhooks refuse."""
from __future__ import annotations

import copy

import pytest

from preftune.deploy.validate import admission_problems, schema_problems
from tests.deploy.conftest import render


@pytest.fixture(scope="module")
def volcano(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text("data: {train: s3://b/p}\n")
    return render(path)[1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text("data: {train: s3://b/p}\ndeploy: {scheduler: kubernetes}\n")
    return render(path)[1]


def _broken(objects, fname, change):
    objects = copy.deepcopy(objects)
    change(objects[fname])
    return objects


def _policies(p):
    return lambda job: job["spec"].__setitem__("policies", p)


ADMISSION_CASES = [
    ("both event and exitCode", "7-job.yaml", _policies([{"event": "PodFailed", "exitCode": 3, "action": "RestartJob"}])),
    ("exit code 0", "7-job.yaml", _policies([{"exitCode": 0, "action": "AbortJob"}])),
    ("duplicate policy exitCode 75", "7-job.yaml",
     _policies([{"exitCode": 75, "action": "RestartJob"}, {"exitCode": 75, "action": "AbortJob"}])),
    ("duplicate policy event PodFailed", "7-job.yaml",
     _policies([{"event": "PodFailed", "action": "RestartJob"}, {"event": "PodFailed", "action": "AbortJob"}])),
    ("neither event nor exitCode", "7-job.yaml", _policies([{"action": "RestartJob"}])),
    ("'*' policy must be the only", "7-job.yaml",
     _policies([{"event": "*", "action": "RestartJob"}, {"event": "PodEvicted", "action": "RestartJob"}])),
    ("action 'Retry' is not allowed", "7-job.yaml", _policies([{"event": "PodFailed", "action": "Retry"}])),
    ("minAvailable 4 is above the total replicas", "7-job.yaml", lambda j: j["spec"].__setitem__("minAvailable", 4)),
    ("unknown job plugin horovod", "7-job.yaml", lambda j: j["spec"]["plugins"].__setitem__("horovod", [])),
    ("master task 'master' is missing", "7-job.yaml", lambda j: j["spec"]["tasks"][0].__setitem__("name", "chief")),
    ("duplicate task name", "7-job.yaml", lambda j: j["spec"]["tasks"][1].__setitem__("name", "master")),
    ("not among the rendered queues", "7-job.yaml", lambda j: j["spec"].__setitem__("queue", "other")),
    ("restartPolicy must be", "7-job.yaml",
     lambda j: j["spec"]["tasks"][0]["template"]["spec"].__setitem__("restartPolicy", "Always")),
    ("longer than 63", "7-job.yaml", lambda j: j["metadata"].__setitem__("name", "x" * 60)),
    ("do-not-disrupt", "7-job.yaml",
     lambda j: j["metadata"].__setitem__("annotations", {"karpenter.sh/do-not-disrupt": "true"})),
    ("weight must be a positive integer", "3-queue.yaml", lambda q: q["spec"].__setitem__("weight", 0)),
    ("namespace set on a cluster-scoped", "3-queue.yaml", lambda q: q["metadata"].__setitem__("namespace", "x")),
    ("exactly one of role, instanceProfile", "1-ec2nodeclass.yaml",
     lambda n: n["spec"].__setitem__("instanceProfile", "p")),
    ("one EFA-only interface per network card", "1-ec2nodeclass.yaml",
     lambda n: n["spec"]["networkInterfaces"][2].__setitem__("networkCardIndex", 0)),
    ("primary interface", "1-ec2nodeclass.yaml", lambda n: n["spec"]["networkInterfaces"].pop(0)),
    ("not family@version", "1-ec2nodeclass.yaml", lambda n: n["spec"].__setitem__("amiSelectorTerms", [{"alias": "ubuntu@1"}])),
    ("requirement key karpenter.sh/nodepool is restricted", "2-nodepool.yaml",
     lambda p: p["spec"]["template"]["spec"]["requirements"].append(
         {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["x"]})),
    ("schedule must come with a duration", "2-nodepool.yaml",
     lambda p: p["spec"]["disruption"]["budgets"].append({"nodes": "0", "schedule": "@daily"})),
]


@pytest.mark.parametrize("expected, fname, change", ADMISSION_CASES, ids=[c[0] for c in ADMISSION_CASES])
def test_admission_rules_catch(volcano, expected, fname, change):
    assert admission_problems(volcano) == []
    problems = admission_problems(_broken(volcano, fname, change))
    assert any(expected in p for p in problems), problems


def test_pod_failure_policy_rules(plain):
    assert admission_problems(plain) == []
    zero = _broken(plain, "7-job.yaml", lambda j: j["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]
                   .__setitem__("values", [0, 78]))
    assert any("must not contain 0" in p for p in admission_problems(zero))
    restart = _broken(plain, "7-job.yaml", lambda j: j["spec"]["template"]["spec"].__setitem__("restartPolicy", "OnFailure"))
    assert any("needs restartPolicy Never" in p for p in admission_problems(restart))


SCHEMA_CASES = [  # (file, change, words expected in the problem)
    ("7-job.yaml", lambda j: j["spec"].__setitem__("maxRetries", 3), "maxRetries"),  # a typo: unknown field
    ("7-job.yaml", lambda j: j["spec"].__setitem__("minAvailable", "all"), "'all' is not of type 'integer'"),
    ("7-job.yaml", lambda j: j["spec"]["policies"][2].__setitem__("event", "NodeLost"), "NodeLost"),
    ("7-job.yaml", lambda j: j["spec"]["tasks"][0]["template"]["spec"]["containers"][0].__setitem__("gpus", 8), "gpus"),
    ("2-nodepool.yaml", lambda p: p["spec"]["disruption"].__setitem__("consolidationPolicy", "WhenIdle"), "WhenIdle"),
    ("2-nodepool.yaml", lambda p: p["spec"]["template"]["spec"].__setitem__("expireAfter", "7d"), "7d"),
    ("1-ec2nodeclass.yaml", lambda n: n["spec"].__setitem__("instanceStorePolicy", "RAID1"), "RAID1"),
    ("1-ec2nodeclass.yaml", lambda n: n["spec"]["blockDeviceMappings"][0]["ebs"].__setitem__("volumeSize", "200GB"),
     "200GB"),
    ("4-pvc.yaml", lambda c: c["spec"].__setitem__("accesModes", ["ReadWriteMany"]), "accesModes"),
    ("5-configmap.yaml", lambda c: c.__setitem__("data", {"config.yaml": 3}), "3 is not of type 'string'"),
]


@pytest.mark.parametrize("fname, change, words", SCHEMA_CASES, ids=[c[2] for c in SCHEMA_CASES])
def test_schema_check_catches(volcano, crd_dir, fname, change, words):
    problems, _ = schema_problems(_broken(volcano, fname, change), crd_dir)
    assert any(words in p and p.startswith(fname) for p in problems), problems


def test_schema_check_of_the_indexed_job_and_service(plain, crd_dir):
    assert schema_problems(plain, crd_dir)[0] == []
    broken = _broken(plain, "6-service.yaml", lambda s: s["spec"].__setitem__("clusterIp", "None"))
    assert any("clusterIp" in p for p in schema_problems(broken, crd_dir)[0])
    broken = _broken(plain, "7-job.yaml", lambda j: j["spec"].__setitem__("completionMode", 3))
    assert schema_problems(broken, crd_dir)[0]


def test_crds_load_from_kubectls_list_output(crd_dir, tmp_path):
    import yaml

    from preftune.deploy.validate import load_crds

    items = [yaml.safe_load(p.read_text()) for p in sorted(crd_dir.glob("*.yaml"))]
    (tmp_path / "crds.yaml").write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    assert set(load_crds(tmp_path)) == set(load_crds(crd_dir)) == {
        ("batch.volcano.sh/v1alpha1", "Job"), ("karpenter.sh/v1", "NodePool"), ("karpenter.k8s.aws/v1", "EC2NodeClass")}
