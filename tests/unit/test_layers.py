"""The house's floors (DESIGN.md, "Layout: three floors"), checked on the code.

    walbridge/                   the operator's face: imports anything below it
    producer/   spark_consumer/  the two data paths: never each other, never walbridge/
    schemas/                     what every process agrees on: imports no floor above it

Every import counts, also those inside functions and under ``if``: the
modules are read with :mod:`ast` (Cython ``.pyx`` files by their Python import
lines), never imported. Besides the floors, no two files may import each other
in a circle, however long.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("walbridge", "producer", "spark_consumer", "schemas")
# What each package may import of the others.
ALLOWED = {
    "walbridge": {"walbridge", "producer", "spark_consumer", "schemas"},
    "producer": {"producer", "schemas"},
    "spark_consumer": {"spark_consumer", "schemas"},
    "schemas": {"schemas"},
}
_PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+(.+)|import\s+([\w.]+))", re.M)


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of the four packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(path: Path, module: str) -> list[tuple[str, int]]:
    """``(dotted name, line)`` of everything the file imports, wherever the
    statement stands; ``from a import b`` yields ``a.b`` (a module or a name in a)."""
    text = path.read_text()
    if path.suffix == ".pyx":
        found = []
        for m in _PYX_IMPORT.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if m.group(3):
                found.append((m.group(3), line))
            elif not m.group(0).lstrip().startswith("cimport"):
                found += [(f"{m.group(1)}.{n.strip().split()[0]}", line) for n in m.group(2).strip("()").split(",")]
        return found
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module → {imported module of the four packages: line of the first such import}."""
    mods = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(path, module):
            # The longest prefix that is one of our modules: `from a import b`
            # is module a.b if there is one, else a name inside module a.
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every breach of the floors and every import cycle, one line each."""
    graph = import_graph(root)
    mods = modules(root)
    out = []
    for module, edges in sorted(graph.items()):
        floor = module.split(".")[0]
        for target, line in sorted(edges.items()):
            if target.split(".")[0] not in ALLOWED[floor]:
                out.append(f"{mods[module].relative_to(root)}:{line}: {floor}/ imports {target}")
    for component in cycles(graph):
        ties = [f"{a} -> {b}" for a in component for b in graph[a] if b in component]
        out.append(f"import cycle between {', '.join(component)}: {'; '.join(ties)}")
    return out


def test_the_floors_hold_and_no_file_imports_itself_in_a_circle():
    assert violations(ROOT) == []


def test_every_package_is_read():
    mods = modules(ROOT)
    for package in PACKAGES:
        assert package in mods
    assert "spark_consumer._fastdecode" in mods and "producer._fastcodec" in mods
    # An import inside a function is an arrow too.
    assert "spark_consumer.supervisor" in import_graph(ROOT)["walbridge.runtime"]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, body in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


@pytest.mark.parametrize("files, expected", [
    ({"schemas/config.py": "def f():\n    from producer.shapes import x\n", "producer/shapes.py": ""},
     ["schemas/config.py:2: schemas/ imports producer.shapes"]),
    ({"spark_consumer/job.py": "from producer import metrics\n", "producer/metrics.py": ""},
     ["spark_consumer/job.py:1: spark_consumer/ imports producer.metrics"]),
    ({"producer/pipeline.py": "import walbridge.cli\n", "walbridge/cli.py": ""},
     ["producer/pipeline.py:1: producer/ imports walbridge.cli"]),
    ({"schemas/a.pyx": "from libc.stdint cimport int64_t\nfrom walbridge import up\n", "walbridge/up.py": ""},
     ["schemas/a.pyx:2: schemas/ imports walbridge.up"]),
    ({"walbridge/a.py": "from walbridge import b\n", "walbridge/b.py": "from walbridge.c import x\n",
      "walbridge/c.py": "if True:\n    from . import a\n"},
     ["import cycle between walbridge.a, walbridge.b, walbridge.c: walbridge.a -> walbridge.b; "
      "walbridge.b -> walbridge.c; walbridge.c -> walbridge.a"]),
    ({"walbridge/a.py": "from producer import b\nfrom schemas.wire import X\n", "producer/b.py": "",
      "schemas/wire.py": "X = 1\n"}, []),
], ids=["schemas-up", "consumer-to-producer", "walbridge-from-below", "pyx", "cycle", "allowed"])
def test_the_check_finds_each_kind_of_breach(tmp_path, files, expected):
    assert violations(_tree(tmp_path, files)) == expected
