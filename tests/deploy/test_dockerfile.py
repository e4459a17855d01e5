"""The Dockerfile, checked without building it: base, extras, user, and the entrypoint the pods use."""
from __future__ import annotations

import json
import re

from preftune.deploy.manifests import ENTRYPOINT, launch_command
from tests.conftest import ROOT
from tests.deploy.conftest import render


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [tuple(ln.split(None, 1)) for ln in lines]


def test_base_image_is_cuda_pytorch():
    (base,) = [arg for op, arg in instructions() if op == "FROM"]
    args = dict(arg.split("=", 1) for op, arg in instructions() if op == "ARG" and "=" in arg)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base


def test_installs_preftune_with_s3_lora_and_vllm_extras():
    args = dict(arg.split("=", 1) for op, arg in instructions() if op == "ARG" and "=" in arg)
    runs = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], " ".join(arg for op, arg in instructions() if op == "RUN"))
    m = re.search(r"pip install \"?\.\[([a-z0-9,]+)\]", runs)
    assert m and {"s3", "lora", "vllm"} <= set(m.group(1).split(","))
    assert "torch" not in re.sub(r"\.\[[^\]]*\]", "", runs.split("pip install", 1)[1].split("&&")[0])


def test_runs_as_the_non_root_user_the_pods_expect(tmp_path):
    users = [arg for op, arg in instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {train: s3://b/p}\n")
    pod = render(cfg)[1]["7-job.yaml"]["spec"]["tasks"][0]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == users[-1].split(":")[0]


def test_entrypoint_matches_the_rendered_command():
    (entry,) = [json.loads(arg) for op, arg in instructions() if op == "ENTRYPOINT"]
    assert entry == ENTRYPOINT == launch_command()[:len(entry)]


def test_the_rendered_command_is_a_preftune_launch_the_cli_accepts():
    from preftune.cli.command import parser

    args = parser().parse_args(launch_command()[len(ENTRYPOINT):])
    assert (args.command, args.config) == ("launch", "/etc/preftune/config.yaml")
