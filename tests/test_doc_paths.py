"""Every source path and module the docs and the code's comments name exists: `path/x.py`,
`preftune.x.y`, and `module.name` where module is one of the package's modules (config keys such
as `data.tools` are checked by the config tests instead)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "preftune"
# folders a run or a job writes (named in docs as outputs), and placeholders: not source paths
OUTPUTS = {"final", "runs", "shards", "step-N", "checkpoints", "path", "crds", "OUTPUT_DIR"}
PATH = re.compile(r"(?<![\w/.$-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|md|yaml|sh))\b")
DOTTED = re.compile(r"(?<![\w.])(preftune(?:\.[A-Za-z_]\w*)+)")
NAMED = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)`")
# third-party names that share a basename with one of preftune's modules (vLLM's LLM, Karpenter's settings)
HOMONYMS = {"vllm", "settings"}
SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "safetensors", "txt", "parquet", "csv", "pt", "sh", "html", "png"}


def _sources() -> list[tuple[Path, str]]:
    files = [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "bench" / "README.md", *PACKAGE.rglob("*.py"),
             *ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py")]
    return [(f, f.read_text()) for f in files]


def _is_source_path(path: str) -> bool:
    return (ROOT / path).exists() or (PACKAGE / path).exists() or (ROOT / "docs" / path).exists()


def _defines(files: list[Path], name: str) -> bool:
    """Defined or imported (a package's re-export) in one of the files."""
    pattern = re.compile(rf"^\s*(?:def|class|async def)\s+{name}\b|^\s*{name}\s*[:=]|^(?:from|import)\b.*\b{name}\b"
                         rf"|^\s+{name},", re.M)
    return any(pattern.search(f.read_text()) for f in files)


def _module_files() -> dict[str, list[Path]]:
    """Module or package basename -> its files."""
    out: dict[str, list[Path]] = {}
    for p in PACKAGE.rglob("*.py"):
        out.setdefault(p.stem, []).append(p)
        if p.name == "__init__.py":
            out.setdefault(p.parent.name, []).extend(sorted(p.parent.glob("*.py")))
    return out


def test_named_paths_exist():
    missing = sorted({f"{f.relative_to(ROOT)}: {m.group(1)}" for f, text in _sources() for m in PATH.finditer(text)
                      if m.group(1).split("/")[0] not in OUTPUTS and not _is_source_path(m.group(1))})
    assert not missing, missing


def _resolves(dotted: str) -> bool:
    """`preftune.a.b.name` imports: the longest module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_dotted_module_names_exist():
    missing = sorted({f"{f.relative_to(ROOT)}: {m.group(1)}" for f, text in _sources() for m in DOTTED.finditer(text)
                      if m.group(1).rsplit(".", 1)[1] not in SUFFIXES and not _resolves(m.group(1))})
    assert not missing, missing


def test_module_dot_name_references_exist():
    """`head.token_stats`, `families.own_class`, ...: the module exists and defines the name. A word
    that is also a config section (`data.tools`, `model.lora`) is a key, not a module."""
    from preftune.config import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    modules = _module_files()
    stale = {"models", "train"}  # package names from before the re-layer
    missing = sorted({f"{f.relative_to(ROOT)}: {m.group(0)}" for f, text in _sources() for m in NAMED.finditer(text)
                      if m.group(1) not in sections | HOMONYMS | {"preftune"} and m.group(2) not in SUFFIXES and (
                          m.group(1) in stale or (
                          m.group(1) in modules and not _defines(modules[m.group(1)], m.group(2))))})
    assert not missing, missing
