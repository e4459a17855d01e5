"""The docs: the config reference is current, the README's commands and Python examples run."""
import json
import re
from pathlib import Path

from preftune.config import Config, reference, to_dict
from preftune.config.fields import keys

README = Path(__file__).resolve().parents[1] / "README.md"


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + k + ".")
        else:
            yield prefix + k, v


def test_the_config_reference_is_current():
    """docs/config.md is generated from the config declarations (`python -m preftune.config`)."""
    docs = README.parent / "docs" / "config.md"
    assert docs.read_text() == reference(Config), "run: python -m preftune.config"
    rows = dict(re.findall(r"^\| `([a-z_.0-9]+)` \| `[^`]*` \| `([^`]*)` \|", docs.read_text(), flags=re.M))
    for key, default in _flat(to_dict(Config())):
        assert key in rows, f"docs/config.md lacks {key}"
        assert json.loads(rows[key]) == default, f"docs/config.md default of {key} is {rows[key]}, config says {default!r}"


def test_every_key_declares_its_help():
    assert all(f.metadata.get("help") for _, f, _ in keys(Config))


def test_readme_names_the_test_command_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in README.read_text()


def test_from_python_examples_run(tmp_path, monkeypatch):
    """The README's "From Python" code, run as written except shorter (2 steps) and into tmp_path."""
    text = README.read_text()
    section = text[text.index("## From Python"):text.index("## Exit codes")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(README.parent)
    for code in blocks:
        for long, short in (("\"max_steps=50\"", "\"max_steps=2\", \"grpo.prompts_per_step=2\", \"grpo.num_generations=2\""),
                            ("cfg.max_steps = 50", "cfg.max_steps = 2"),
                            ("runs/", f"{tmp_path}/")):
            code = code.replace(long, short)
        assert "max_steps = 2" in code or "max_steps=2" in code
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
        result = namespace["result"]
        assert result.step == 2 and result.model_path.is_dir() and str(result.output_dir).startswith(str(tmp_path))
