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
    ("both event and exitCode", "job.yaml", _policies([{"event": "PodFailed", "exitCode": 3, "action": "RestartJob"}])),
    ("exit code 0", "job.yaml", _policies([{"exitCode": 0, "action": "AbortJob"}])),
    ("duplicate policy exitCode 75", "job.yaml",
     _policies([{"exitCode": 75, "action": "RestartJob"}, {"exitCode": 75, "action": "AbortJob"}])),
    ("duplicate policy event PodFailed", "job.yaml",
     _policies([{"event": "PodFailed", "action": "RestartJob"}, {"event": "PodFailed", "action": "AbortJob"}])),
    ("neither event nor exitCode", "job.yaml", _policies([{"action": "RestartJob"}])),
    ("'*' policy must be the only", "job.yaml",
     _policies([{"event": "*", "action": "RestartJob"}, {"event": "PodEvicted", "action": "RestartJob"}])),
    ("action 'Retry' is not allowed", "job.yaml", _policies([{"event": "PodFailed", "action": "Retry"}])),
    ("minAvailable 4 is above the total replicas", "job.yaml", lambda j: j["spec"].__setitem__("minAvailable", 4)),
    ("unknown job plugin horovod", "job.yaml", lambda j: j["spec"]["plugins"].__setitem__("horovod", [])),
    ("master task 'master' is missing", "job.yaml", lambda j: j["spec"]["tasks"][0].__setitem__("name", "chief")),
    ("duplicate task name", "job.yaml", lambda j: j["spec"]["tasks"][1].__setitem__("name", "master")),
    ("not among the rendered queues", "job.yaml", lambda j: j["spec"].__setitem__("queue", "other")),
    ("restartPolicy must be", "job.yaml",
     lambda j: j["spec"]["tasks"][0]["template"]["spec"].__setitem__("restartPolicy", "Always")),
    ("longer than 63", "job.yaml", lambda j: j["metadata"].__setitem__("name", "x" * 60)),
    ("do-not-disrupt", "job.yaml",
     lambda j: j["metadata"].__setitem__("annotations", {"karpenter.sh/do-not-disrupt": "true"})),
    ("weight must be a positive integer", "queue.yaml", lambda q: q["spec"].__setitem__("weight", 0)),
    ("namespace set on a cluster-scoped", "queue.yaml", lambda q: q["metadata"].__setitem__("namespace", "x")),
    ("exactly one of role, instanceProfile", "ec2nodeclass.yaml",
     lambda n: n["spec"].__setitem__("instanceProfile", "p")),
    ("one EFA-only interface per network card", "ec2nodeclass.yaml",
     lambda n: n["spec"]["networkInterfaces"][2].__setitem__("networkCardIndex", 0)),
    ("primary interface", "ec2nodeclass.yaml", lambda n: n["spec"]["networkInterfaces"].pop(0)),
    ("not family@version", "ec2nodeclass.yaml", lambda n: n["spec"].__setitem__("amiSelectorTerms", [{"alias": "ubuntu@1"}])),
    ("requirement key karpenter.sh/nodepool is restricted", "nodepool.yaml",
     lambda p: p["spec"]["template"]["spec"]["requirements"].append(
         {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["x"]})),
    ("schedule must come with a duration", "nodepool.yaml",
     lambda p: p["spec"]["disruption"]["budgets"].append({"nodes": "0", "schedule": "@daily"})),
]


@pytest.mark.parametrize("expected, fname, change", ADMISSION_CASES, ids=[c[0] for c in ADMISSION_CASES])
def test_admission_rules_catch(volcano, expected, fname, change):
    assert admission_problems(volcano) == []
    problems = admission_problems(_broken(volcano, fname, change))
    assert any(expected in p for p in problems), problems


def test_pod_failure_policy_rules(plain):
    assert admission_problems(plain) == []
    zero = _broken(plain, "job.yaml", lambda j: j["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]
                   .__setitem__("values", [0, 78]))
    assert any("must not contain 0" in p for p in admission_problems(zero))
    restart = _broken(plain, "job.yaml", lambda j: j["spec"]["template"]["spec"].__setitem__("restartPolicy", "OnFailure"))
    assert any("needs restartPolicy Never" in p for p in admission_problems(restart))


SCHEMA_CASES = [  # (file, change, words expected in the problem)
    ("job.yaml", lambda j: j["spec"].__setitem__("maxRetries", 3), "maxRetries"),  # a typo: unknown field
    ("job.yaml", lambda j: j["spec"].__setitem__("minAvailable", "all"), "'all' is not of type 'integer'"),
    ("job.yaml", lambda j: j["spec"]["policies"][2].__setitem__("event", "NodeLost"), "NodeLost"),
    ("job.yaml", lambda j: j["spec"]["tasks"][0]["template"]["spec"]["containers"][0].__setitem__("gpus", 8), "gpus"),
    ("nodepool.yaml", lambda p: p["spec"]["disruption"].__setitem__("consolidationPolicy", "WhenIdle"), "WhenIdle"),
    ("nodepool.yaml", lambda p: p["spec"]["template"]["spec"].__setitem__("expireAfter", "7d"), "7d"),
    ("ec2nodeclass.yaml", lambda n: n["spec"].__setitem__("instanceStorePolicy", "RAID1"), "RAID1"),
    ("ec2nodeclass.yaml", lambda n: n["spec"]["blockDeviceMappings"][0]["ebs"].__setitem__("volumeSize", "200GB"),
     "200GB"),
    ("pvc.yaml", lambda c: c["spec"].__setitem__("accesModes", ["ReadWriteMany"]), "accesModes"),
    ("configmap.yaml", lambda c: c.__setitem__("data", {"config.yaml": 3}), "3 is not of type 'string'"),
]


@pytest.mark.parametrize("fname, change, words", SCHEMA_CASES, ids=[c[2] for c in SCHEMA_CASES])
def test_schema_check_catches(volcano, crd_dir, fname, change, words):
    problems, _ = schema_problems(_broken(volcano, fname, change), crd_dir)
    assert any(words in p and p.startswith(fname) for p in problems), problems


def test_schema_check_of_the_indexed_job_and_service(plain, crd_dir):
    assert schema_problems(plain, crd_dir)[0] == []
    broken = _broken(plain, "service.yaml", lambda s: s["spec"].__setitem__("clusterIp", "None"))
    assert any("clusterIp" in p for p in schema_problems(broken, crd_dir)[0])
    broken = _broken(plain, "job.yaml", lambda j: j["spec"].__setitem__("completionMode", 3))
    assert schema_problems(broken, crd_dir)[0]
