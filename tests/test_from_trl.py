"""docs/from-trl.md: its preftune scripts run as written (fewer steps, into tmp_path) on the
embedded model, its TRL scripts name only what TRL 1.16 has, and its names table is the one
config/trl.py holds."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from preftune.config.trl import rows

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from-trl.md"


def _blocks() -> list[tuple[str, str]]:
    """(the label before the block: 'TRL 1.16', 'preftune' or '' for shared code, code) in page order."""
    text = PAGE.read_text()
    text = text[:text.index("## Your TRL objects")]  # that section's script runs in tests/test_trl_objects.py
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[:m.start()].rstrip().splitlines()[-1]
        label = "TRL 1.16" if before == "TRL 1.16:" else "preftune" if before == "preftune:" else ""
        out.append((label, m.group(1)))
    return out


def test_the_preftune_scripts_run(tmp_path, monkeypatch):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)  # runs/ lands in tmp_path; examples/ is the repository's
    namespace: dict = {}
    ran = 0
    for label, code in _blocks():
        if label == "TRL 1.16":
            continue
        for long, short in (('"max_steps": 30', '"max_steps": 3'), ('"max_steps": 40', '"max_steps": 4'),
                            ("longer.step == 40", "longer.step == 4")):
            code = code.replace(long, short)
        exec(compile(code, str(PAGE), "exec"), namespace)
        ran += 1
    assert ran >= 6
    assert namespace["result"].step == 3 and namespace["longer"].step == 4
    assert namespace["model"].config.vocab_size > 0  # the final folder loads with transformers
    assert (tmp_path / "runs" / "dpo" / "final").is_dir() and (tmp_path / "runs" / "grpo" / "final").is_dir()


def test_the_trl_scripts_use_trl_1_16_names():
    """Every keyword of the TRL configs on the page is a field of TRL 1.16's config class."""
    trl = pytest.importorskip("trl")
    import dataclasses

    for label, code in _blocks():
        if label != "TRL 1.16":
            continue
        for cls, args in re.findall(r"(\w+Config)\((.*?)\)\n", code, flags=re.S):
            fields = {f.name for f in dataclasses.fields(getattr(trl, cls))}
            for name in re.findall(r"(\w+)=", args):
                assert name in fields, (cls, name)


def test_the_names_table_is_config_trl():
    text = PAGE.read_text()
    table = text[text.index("<!-- trl-names"):text.index("<!-- /trl-names -->")]
    found = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.*) \|$", table, flags=re.M)
    assert found == [(n, k, how) for n, k, how in rows()], "regenerate the table from preftune.config.trl.rows()"
