"""The package's layout: one importable name (vq_gguf) whose modules import each other without cycles, counting
the imports inside functions too (a cycle there still ties two modules into one)."""
import ast
import graphlib
from pathlib import Path

from tests import REPO

# the package's folders in the checkout, as pyproject.toml maps them
PACKAGES = {"vq_gguf": REPO / "vq_export", "vq_gguf.runtime": REPO / "runtime", "vq_gguf.native": REPO / "native",
            "vq_gguf.tools": REPO / "tools"}


def modules() -> dict[str, Path]:
    return {f"{pkg}.{f.stem}" if f.stem != "__init__" else pkg: f
            for pkg, folder in PACKAGES.items() for f in sorted(folder.glob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its body."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_one_top_level_name():
    """pyproject maps every folder under vq_gguf: nothing generic (runtime, native, tools) is importable by
    that name from an installed package."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'packages = ["vq_gguf", "vq_gguf.runtime", "vq_gguf.native", "vq_gguf.tools"]' in text
    for pkg, folder in PACKAGES.items():
        assert f'{pkg if "." not in pkg else chr(34) + pkg + chr(34)} = "{folder.name}"' in text
