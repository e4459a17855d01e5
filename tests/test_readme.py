"""The docs: the config reference is current, the README's commands and Python examples run, and
every relative link in the README and docs/ resolves (file and #anchor)."""
import json
import re
from pathlib import Path

import pytest

from preftune.config import Config, reference, to_dict
from preftune.config.fields import keys

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent
PAGES = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def test_readme_is_short():
    """The README is the ten-minute read; the rest lives in docs/."""
    assert len(README.read_text().splitlines()) <= 300


def test_readme_keeps_the_exit_codes_a_restart_policy_reads():
    text = README.read_text()
    table = text[text.index("## Exit codes"):]
    for code in ("0", "75", "69", "78", "3", "1"):
        assert re.search(rf"^\| {code} \|", table, flags=re.M), f"exit code {code} missing from the README's table"
    assert "restart on 75, give up on 78" in table


_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", flags=re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _slug(title: str) -> str:
    """GitHub's anchor of a heading: a link's text, lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks); repeats get -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path):
    for target in _LINK.findall(_prose(page.read_text())):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            yield target


def test_the_anchor_rule_matches_github():
    assert _slug("Logging: TensorBoard, Weights & Biases, MLflow") == "logging-tensorboard-weights--biases-mlflow"
    assert _slug("`preftune launch CONFIG [KEY=VALUE ...]`: the container entrypoint") \
        == "preftune-launch-config-keyvalue--the-container-entrypoint"
    assert _slug("Results on the embedded examples (measured)") == "results-on-the-embedded-examples-measured"
    assert _slug("GPU: the 0.5B rows in bf16") == "gpu-the-05b-rows-in-bf16"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README) if t.partition("#")[0]}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
