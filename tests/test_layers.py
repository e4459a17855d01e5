"""The package is a plain stack of layers: no import circle, no import pointing up, and imports at
the top of modules except where something heavy is deferred on purpose."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "preftune"
# bottom to top: a module imports only from its own layer or a lower one
LAYERS = [
    {"errors", "atomic", "tensorfile"},  # tensorfile: data-only state files
    {"losses"},  # pure tensor functions (and, torch-free, the names they accept)
    {"config"},  # every key declared once; no torch
    {"data"},  # traces, pairs, groups, prompts, examples, tensor helpers
    {"model"},  # the model file, loading, log-prob passes
    {"rewards"},
    {"distributed"},  # the one module that calls torch.distributed
    {"rollout"},
    {"algorithms"},  # GRPO, DPO, SFT: each its batch, step and task
    {"evaluation"},
    {"run"},  # loop, checkpoints, resume, preemption, output folder, trackers
    {"api", "deploy", "report"},
    {"cli", "__main__"},
]
# the layers' names in docs/ARCHITECTURE.md's table, which `layer_table` generates from LAYERS
LAYER_NAMES = ["base", "losses", "config", "data", "model", "rewards", "distributed", "rollout", "algorithms",
               "evaluation", "run", "entry", "command"]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# third-party imports a function may defer: heavy or optional (FSDP's import alone takes ~0.7 s)
DEFERRED = ("transformers", "peft", "safetensors", "torch.distributed.fsdp", "torch.distributed.checkpoint",
            "torch.distributed.tensor", "torch._dynamo",
            "torch.utils.tensorboard", "wandb", "mlflow", "matplotlib", "fsspec", "jsonschema", "kubernetes_validate",
            "tqdm", "pyarrow", "yaml", "torch", "vllm", "tokenizers", "jinja2")
LIGHT_ONLY = ("torch", "yaml", "pyarrow")  # deferred only by a module that does not already import them
# what the `preftune` process must not import before its signal handler is installed
HEAVY = ("torch", "transformers", "pyarrow", "numpy", "yaml")


def modules() -> dict[str, ast.Module]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(p.read_text())
    return out


MODULES = modules()


def _targets(node) -> list[str]:
    """What an import statement loads: its modules (a name imported from a package that is one of
    its modules counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names]
        return [n for n in names if n in MODULES] or [node.module]
    return []


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def edges(only_top: bool = False) -> dict[str, set[str]]:
    out = {}
    for name, tree in MODULES.items():
        nodes = tree.body if only_top else ast.walk(tree)
        out[name] = {m for n in nodes for t in _targets(n) if t.startswith("preftune")
                     for m in [_resolve(t)] if m and m != name and m != "preftune"}
    return out


def layer(module: str) -> int:
    part = module.split(".")[1] if module.count(".") else "__init__"
    return LAYER.get(part, len(LAYERS))


def test_every_package_has_a_layer():
    parts = {m.split(".")[1] for m in MODULES if m.count(".")}
    assert parts <= set(LAYER), f"give these a layer: {sorted(parts - set(LAYER))}"


def test_no_import_points_up():
    up = [f"{a} -> {b}" for a, deps in edges().items() for b in deps if layer(b) > layer(a)]
    assert not up, up


def test_no_import_circle():
    graph, state, stack = edges(), {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in graph[v]:
            if state.get(w) == 1:
                raise AssertionError(" -> ".join(stack[stack.index(w):] + [w]))
            if w not in state:
                visit(w)
        stack.pop()
        state[v] = 2

    for v in graph:
        if v not in state:
            visit(v)


def _top_third_party(tree) -> set[str]:
    return {t for n in tree.body for t in _targets(n) if not t.startswith("preftune")}


def _heavy(name: str, seen: set | None = None) -> set[str]:
    """Which of HEAVY the module imports at its top, itself or through preftune modules."""
    seen = seen if seen is not None else set()
    seen.add(name)
    found = {t.split(".")[0] for t in _top_third_party(MODULES[name])} & set(HEAVY)
    parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
    for d in edges(only_top=True)[name] | set(parents):
        if d not in seen and d in MODULES:
            found |= _heavy(d, seen)
    return found


def test_imports_inside_functions_defer_something_heavy():
    """A preftune module imported inside a function brings something heavy the importer does not
    import at its top (the CLI starts before torch, even before yaml); a third-party one is heavy or
    optional (DEFERRED)."""
    bad = []
    for name, tree in MODULES.items():
        top = _top_third_party(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in (n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))):
                for t in _targets(node):
                    if t.startswith("preftune"):
                        ok = bool(_heavy(_resolve(t)) - _heavy(name))
                    else:
                        root = next((d for d in DEFERRED if t == d or t.startswith(d + ".")), None)
                        ok = root is not None and not (root in LIGHT_ONLY and root in {x.split(".")[0] for x in top})
                    if not ok:
                        bad.append(f"{name}:{node.lineno} {t}")
    assert not bad, bad


def test_import_preftune_and_its_cli_are_light():
    import subprocess

    code = ("import sys, preftune, preftune.cli.command, preftune.config, preftune.losses.names; "
            "print([m for m in ('torch', 'transformers', 'numpy', 'pyarrow') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"


def test_a_run_imports_only_what_it_uses():
    """What `preftune train` imports on its way to a GRPO run on jsonl prompts (the CLI's parser, the
    API, the loop, the reward registry) leaves out arrow and fsspec (parquet, csv and remote files
    only), the data report behind `preftune cost`, and every optional package (LoRA, vLLM, trackers,
    charts, S3, the Kubernetes checks): each restart after a spot notice would pay for them."""
    import subprocess

    code = ("import sys; from preftune.cli.command import parser; parser(); "
            "import preftune.api, preftune.run.loop, preftune.rewards.functions; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'fsspec', 'pandas', 'peft', "
            "'vllm', 'wandb', 'mlflow', 'tensorboard', 'matplotlib', 's3fs', 'jsonschema', 'kubernetes_validate', "
            "'datasets') or m == 'preftune.data.inspect'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"



def test_a_run_of_the_own_module_imports_no_transformers(tmp_path):
    """A GRPO run on the embedded model, from the config to final/: its config.json, tokenizer and
    generation config are read by preftune, so a restart does not pay for transformers (its
    import pulls in the modeling stack)."""
    import subprocess

    code = ("import sys; from preftune.api import train; "
            f"train('examples/grpo.yaml', overrides=['output_dir={tmp_path / 'run'}', 'max_steps=1', "
            "'log.progress_bar=false']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "run" / "final" / "tokenizer.json").is_file()

# ---------------------------------------------------------------- docs/ARCHITECTURE.md's layer table

ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
TABLE_HEAD = "| layer | modules | what it owns |\n|---|---|---|\n"


def _layer_modules(names: set[str]) -> str:
    """The layer's files as the table lists them: `pkg/a.py`, `b.py`, ... or `x.py`; `pkg/` for cli-like packages."""
    cells = []
    for name in sorted(names):
        if (PACKAGE / f"{name}.py").is_file():
            cells.append(f"`{name}.py`")
            continue
        files = sorted(p.name for p in (PACKAGE / name).glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        cells += [f"`{name}/{f}`" if i == 0 else f"`{f}`" for i, f in enumerate(files)] or [f"`{name}/`"]
    return ", ".join(cells)


def layer_table(owns: dict[str, str]) -> str:
    """The table, bottom to top in the order the lint enforces, each layer's files from the tree and
    its "what it owns" text from `owns` (by layer name)."""
    rows = [f"| {n} | {_layer_modules(names)} | {owns.get(n, '')} |" for n, names in zip(LAYER_NAMES, LAYERS)]
    return TABLE_HEAD + "\n".join(rows) + "\n"


def _doc_table(text: str) -> tuple[int, int, dict[str, str]]:
    """Where the table is in the doc and its "what it owns" cells by layer name."""
    start = text.index(TABLE_HEAD)
    end = text.index("\n\n", start) + 1
    owns = {}
    for line in text[start + len(TABLE_HEAD):end].strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        owns[cells[0]] = cells[-1]
    return start, end, owns


def test_the_architecture_layer_table_is_the_enforced_order():
    """docs/ARCHITECTURE.md's table lists the layers in the order this lint enforces, with every
    module of the tree; `python -m tests.test_layers` rewrites it (keeping each layer's text)."""
    assert len(LAYER_NAMES) == len(LAYERS)
    text = ARCHITECTURE.read_text()
    start, end, owns = _doc_table(text)
    assert set(owns) == set(LAYER_NAMES), f"layers in the doc {sorted(owns)} vs the lint {LAYER_NAMES}"
    assert text[start:end] == layer_table(owns), "run `python -m tests.test_layers` to regenerate the table"


if __name__ == "__main__":
    doc = ARCHITECTURE.read_text()
    a, b, cells = _doc_table(doc)
    ARCHITECTURE.write_text(doc[:a] + layer_table(cells) + doc[b:])
    print(f"wrote the layer table of {ARCHITECTURE}")


# the only modules that call torch.distributed: the process group, FSDP2 applied from outside, the
# weights read into shards and written from them, and the checkpointer's sharded state dicts
TORCH_DISTRIBUTED = {"preftune.distributed.group", "preftune.distributed.fsdp", "preftune.distributed.weights",
                     "preftune.run.shards"}


def _uses_torch_distributed(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed")
                                                for a in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "distributed" \
                and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return True
    return False


def test_only_the_distributed_modules_call_torch_distributed():
    users = {name for name, tree in MODULES.items() if _uses_torch_distributed(tree)}
    assert users <= TORCH_DISTRIBUTED, f"torch.distributed outside its modules: {users - TORCH_DISTRIBUTED}"
    assert users == TORCH_DISTRIBUTED  # the set says which modules these are
