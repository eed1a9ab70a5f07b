"""The package's dependency rules (docs/architecture.md), read from the source with ast, function-local imports
included, so a lazy import cannot hide a dependency:
- imports only go down the layers of the data path: a module may import its own sub-package and those below
  it, never one above;
- core (the scheduler and its step types) imports no model code and, from sample/ and lora/, only plain data
  types: no sample/ or lora/ module core imports reaches torch;
- only config/ and entrypoints/ read the environment: everything below receives its settings in the config."""
import ast
import re
from pathlib import Path

import qwenserve

PACKAGE = Path(qwenserve.__file__).parent

# bottom to top; sub-packages on one line share a rank and may not import each other
LAYERS = [
    ("config",),
    ("kernels",),
    ("distributed",),  # process groups and collectives: what the model layers call, not the model
    ("model",),
    ("sample", "lora"),  # lora: adapters over the model's layers; its request type is plain data core carries
    ("spec_decode",),  # draft proposers (speculative decoding), run by the worker
    ("core",),
    ("worker",),
    ("executor",),
    ("engine",),
    ("benchmarks", "tools"),
    ("entrypoints",),
    ("__init__",),  # the package root re-exports the public API
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def sub_package(module: str) -> str:
    """'qwenserve.core.scheduler' -> 'core'; the root module -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts[:1]
    return ".".join(parts)


def qwenserve_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported qwenserve module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "qwenserve"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "qwenserve":
                continue
            if target == "qwenserve":  # `from qwenserve import x`: x may be a sub-package
                found += [(node.lineno, f"qwenserve.{a.name}") for a in node.names]
                continue
            # `from qwenserve.sample import logprob` imports the module qwenserve.sample.logprob
            modules = {f"{target}.{a.name}" for a in node.names if module_path(f"{target}.{a.name}")}
            found += [(node.lineno, m) for m in sorted(modules)]
            if len(modules) < len(node.names):
                found.append((node.lineno, target))
    return found


def module_path(module: str) -> Path | None:
    """The source file of a qwenserve module ('qwenserve.core.step' -> .../core/step.py), or None."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def torch_import_line(path: Path) -> int | None:
    """The line of the file's first torch import (function-local ones included), or None."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            lines += [node.lineno for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            lines.append(node.lineno)
    return min(lines, default=None)


def path_to_torch(module: str, seen: set[str]) -> list[str]:
    """How `module` reaches torch through qwenserve modules: ['qwenserve/a.py:3 imports qwenserve.b', ...,
    'qwenserve/b.py:6 imports torch'], or [] when it does not."""
    path = module_path(module)
    if path is None or module in seen:
        return []
    seen.add(module)
    where = path.relative_to(PACKAGE.parent)
    line = torch_import_line(path)
    if line is not None:
        return [f"{where}:{line} imports torch"]
    for line, target in qwenserve_imports(path):
        rest = path_to_torch(target, seen)
        if rest:
            return [f"{where}:{line} imports {target}"] + rest
    return []


# the environment's names in the os module: reading them is reading a setting
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_uses(path: Path) -> list[int]:
    """Lines that use the environment: os.environ[...], os.environ.get, os.getenv (os under any alias), and
    `from os import environ` (whose later uses are then bare names)."""
    tree = ast.parse(path.read_text(), str(path))
    os_names = {"os"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                         for a in node.names if a.name == "os" and a.asname}
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT and isinstance(node.value, ast.Name)
                and node.value.id in os_names):
            lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENVIRONMENT:
            lines.add(node.lineno)
    return sorted(lines)


def test_every_sub_package_has_a_layer():
    subs = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    subs |= {p.stem for p in PACKAGE.glob("*.py")}
    assert subs <= set(RANK), f"place {sorted(subs - set(RANK))} in LAYERS (and docs/architecture.md's layout table)"


def test_imports_only_go_down_the_layers():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = sub_package(module_name(path))
        for line, target in qwenserve_imports(path):
            there = sub_package(target)
            if there in RANK and (RANK[there] > RANK[here] or (RANK[there] == RANK[here] and there != here)):
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {target} ({there})")
    assert not violations, "imports that go up the layers:\n" + "\n".join(violations)


def test_the_checker_sees_upward_and_lazy_imports(tmp_path, monkeypatch):
    """The test above would pass vacuously if imports were not found: plant one of each kind and see them."""
    fake = tmp_path / "qwenserve"
    (fake / "core").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "bad.py").write_text(
        "from qwenserve.worker.worker import Worker\n"
        "def f():\n    from ..engine import llm_engine\n"
        "import qwenserve.entrypoints.llm\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    found = [target for _, target in qwenserve_imports(fake / "core" / "bad.py")]
    assert sorted(found) == ["qwenserve.engine", "qwenserve.entrypoints.llm", "qwenserve.worker.worker"]
    assert all(RANK[sub_package(t)] > RANK["core"] for t in found)


# torch-heavy layers the scheduler never needs: it plans steps over plain data
CORE_MAY_NOT_IMPORT = ("kernels", "distributed", "model")
# layers core may take only plain data types from (a request's sampling parameters, its LoRA adapter)
PLAIN_DATA_ONLY = ("sample", "lora")


def core_dependency_problems() -> list[str]:
    problems = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for line, target in qwenserve_imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if sub_package(target) in CORE_MAY_NOT_IMPORT:
                problems.append(f"{where} imports {target}")
            elif sub_package(target) in PLAIN_DATA_ONLY:
                chain = path_to_torch(target, set())
                if chain:
                    problems.append(f"{where} imports {target}, which reaches torch: " + "; ".join(chain))
    return problems


def test_core_imports_no_model_code_and_only_plain_sample_types():
    problems = core_dependency_problems()
    assert not problems, ("core imports model code or torch-heavy sample code (move the plain data type it "
                          "needs into a module of its own):\n" + "\n".join(problems))


# the entry points read the environment once, into the config; config/ holds the variables' names and parsing
READS_ENVIRONMENT = ("config", "entrypoints")


def environment_problems() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if sub_package(module_name(path)) not in READS_ENVIRONMENT:
            problems += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in environment_uses(path)]
    return problems


def test_only_config_and_entrypoints_read_the_environment():
    problems = environment_problems()
    assert not problems, ("the environment is read outside config/ and entrypoints/ (make it a config field "
                          "whose default comes from the variable):\n" + "\n".join(problems))


def test_the_checkers_see_torch_reached_from_core_and_environment_reads(tmp_path, monkeypatch):
    """The two tests above would pass vacuously if nothing were found: plant each kind and see it named."""
    fake = tmp_path / "qwenserve"
    for sub in ("core", "sample", "model", "worker", "config"):
        (fake / sub).mkdir(parents=True)
        (fake / sub / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "sample" / "record.py").write_text("from dataclasses import dataclass\n")
    (fake / "sample" / "heavy.py").write_text("from . import helper\n")
    (fake / "sample" / "helper.py").write_text("import math\ndef f():\n    import torch.nn\n")
    (fake / "core" / "step.py").write_text(
        "from qwenserve.sample import record\n"
        "from qwenserve.sample import heavy\n"
        "def g():\n    from ..model import layers\n")
    (fake / "worker" / "bad.py").write_text(
        "import os\nimport os as system\nfrom os import environ as env\n"
        "a = os.environ['X']\nb = os.getenv('Y')\nc = system.environ.get('Z')\nd = os.path.join('e')\n")
    (fake / "config" / "fine.py").write_text("import os\nx = os.environ.get('X')\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert core_dependency_problems() == [
        "qwenserve/core/step.py:2 imports qwenserve.sample.heavy, which reaches torch: "
        "qwenserve/sample/heavy.py:1 imports qwenserve.sample.helper; qwenserve/sample/helper.py:3 imports torch",
        "qwenserve/core/step.py:4 imports qwenserve.model",
    ]
    assert environment_problems() == [f"qwenserve/worker/bad.py:{line}" for line in (3, 4, 5, 6)]


def test_layout_table_matches_the_tree():
    """Every source file is in docs/architecture.md's layout table (by itself or under a listed folder), and every path
    the table lists exists."""
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = doc.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        listed |= {names[0]} | {folder + n for n in names[1:]}
    missing_paths = sorted(p for p in listed if not (PACKAGE / p).exists())
    assert not missing_paths, f"docs/architecture.md lists paths that do not exist: {missing_paths}"
    folders = {p for p in listed if p.endswith("/")}
    unlisted = []
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.suffix not in (".py", ".cpp", ".h") or "__pycache__" in rel:
            continue
        if path.name == "__init__.py" and path.stat().st_size == 0 or rel == "__init__.py":
            continue
        if rel not in listed and not any(rel.startswith(f) for f in folders):
            unlisted.append(rel)
    assert not unlisted, f"add to docs/architecture.md's layout table: {sorted(unlisted)}"


# the modules between a checkpoint and the model class: a family (Qwen2, Qwen3, ...) is one file under
# model/models/, so none of these may name one
FAMILY_NEUTRAL = ["model/registry.py", "model/interface.py", "model/loader/checkpoint.py",
                  "model/loader/model_loader.py", "model/loader/resolve.py", "model/layers/decode_layers.py",
                  *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "worker").glob("*.py"))]


def family_names(path: Path) -> list[str]:
    """Identifiers and string literals (docstrings aside) that name a Qwen family, e.g. Qwen2Attention, "qwen3"."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and ast.get_docstring(node, clean=False) is not None}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
            text = {ast.Name: "id", ast.Attribute: "attr", ast.alias: "name"}[type(node)]
            text = getattr(node, text)
        else:
            continue
        if re.search(r"(?i)qwen(?!serve)", text):
            found.append(f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}: {text[:60]!r}")
    return found


def test_the_model_seam_names_no_family():
    """The registry, the loader, the runner and the one-call decode know families only through the registry and
    the layers' declared parts: no `if architecture == "Qwen3..."`, no family's class or constant."""
    found = [hit for name in FAMILY_NEUTRAL for hit in family_names(PACKAGE / name)]
    assert not found, found
    assert len(FAMILY_NEUTRAL) > 8  # the worker's modules were found
