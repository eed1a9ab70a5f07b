"""Imports only go down the layers of the data path (README, "Architecture"): a module may import its own
sub-package and those below it, never one above. Read from the source with ast, function-local imports
included, so a lazy import cannot hide an upward dependency."""
import ast
from pathlib import Path

import qwenserve

PACKAGE = Path(qwenserve.__file__).parent

# bottom to top; sub-packages on one line share a rank and may not import each other
LAYERS = [
    ("config",),
    ("kernels",),
    ("distributed",),  # process groups and collectives: what the model layers call, not the model
    ("model",),
    ("sample",),
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
            else:
                found.append((node.lineno, target))
    return found


def test_every_sub_package_has_a_layer():
    subs = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    subs |= {p.stem for p in PACKAGE.glob("*.py")}
    assert subs <= set(RANK), f"place {sorted(subs - set(RANK))} in LAYERS (and the README's layout table)"


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


def test_readme_layout_table_matches_the_tree():
    """Every source file is in the README's layout table (by itself or under a listed folder), and every path
    the table lists exists."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        listed |= {names[0]} | {folder + n for n in names[1:]}
    missing_paths = sorted(p for p in listed if not (PACKAGE / p).exists())
    assert not missing_paths, f"the README lists paths that do not exist: {missing_paths}"
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
    assert not unlisted, f"add to the README's layout table: {sorted(unlisted)}"
