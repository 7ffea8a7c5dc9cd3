"""The package's shape: no import loops, no private names imported across files, no file over 500 lines.

Files are parsed with ``ast``, never imported. The graph covers ``quantkit`` (quantkit/) and ``quantkit.kernels``
(the kernels/ folder, shipped under that name). Every import statement counts, wherever it stands: at module level,
inside a function (a "lazy" import), or under ``if TYPE_CHECKING``. A lazy import that closes a loop is still a
loop, only hidden until the function runs, so it fails here like any other.

An edge goes from the importing module to the module it names: ``from a.b import c`` reaches ``a.b.c`` when that is
a module, else ``a.b`` (its ``__init__``); the packages above the target, which Python also runs, are not edges
(every module would otherwise loop through ``quantkit/__init__.py``).

"Private" is a name with one leading underscore defined in another file: ``from quantkit.x import _helper``. A
module whose own name starts with an underscore (``kernels/_device.py``, ``quantkit/_version.py``) is private to
its package and may be imported inside it; dunder names (``__version__``) are public.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"quantkit": REPO / "quantkit", "quantkit.kernels": REPO / "kernels"}
MAX_LINES = 500


@dataclass
class Graph:
    files: dict[str, Path]  # module name -> file
    edges: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # importer -> imported -> line numbers
    private: list[tuple[str, int, str, str]] = field(default_factory=list)  # (importer, line, module, name)


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file for every .py under each package folder (``__init__.py`` is the package itself)."""
    files = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, files: dict[str, Path]) -> str | None:
    """The longest module prefix of a dotted ``name`` that is one of ``files``."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(packages: dict[str, Path] = PACKAGES) -> Graph:
    graph = Graph(module_files(packages))
    roots = tuple(packages)
    for module, path in graph.files.items():
        out = graph.edges.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[tuple[str | None, str | None]] = []  # (module reached, name imported from it)
            if isinstance(node, ast.Import):
                targets = [(_owner(a.name, graph.files), None) for a in node.names if a.name.startswith(roots)]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                if not source.startswith(roots):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append((sub, None) if sub in graph.files else (_owner(source, graph.files), alias.name))
            for target, name in targets:
                if target is None or target == module:
                    continue
                out.setdefault(target, []).append(node.lineno)
                if name and name.startswith("_") and not name.startswith("__"):
                    graph.private.append((module, node.lineno, target, name))
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.edges.get(v, {}):
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

    for v in graph.files:
        if v not in index:
            visit(v)
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def describe(graph: Graph, component: list[str]) -> str:
    """One loop as the imports that close it: ``a.py:12 imports b`` per edge inside the component."""
    lines = []
    for a in component:
        where = shown(graph.files[a])
        for b, at in sorted(graph.edges[a].items()):
            if b in component:
                lines.append(f"  {where}:{','.join(map(str, at))} imports {b}")
    return "\n".join(lines)


def part_of(module: str) -> str:
    return "quantkit.kernels" if module.startswith("quantkit.kernels") else "quantkit"


GRAPH = import_graph()


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_cycles(package):
    loops = [c for c in cycles(GRAPH) if part_of(c[0]) == package]
    report = "\n".join(f"loop of {len(c)} modules:\n{describe(GRAPH, c)}" for c in loops)
    assert not loops, f"{len(loops)} import loop(s) in {package}:\n{report}"


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_private_names_imported_across_files(package):
    found = [
        f"  {shown(GRAPH.files[m])}:{line} imports {name} from {target}"
        for m, line, target, name in GRAPH.private
        if part_of(m) == package
    ]
    assert not found, "private names imported from another file (make them public or move them):\n" + "\n".join(found)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_file_over_500_lines(package):
    folder = PACKAGES[package]
    long = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(folder.rglob("*.py"))}
    over = [f"  {shown(p)}: {n} lines" for p, n in long.items() if n > MAX_LINES]
    assert not over, f"files over {MAX_LINES} lines (split them by noun):\n" + "\n".join(over)


# Imports point downstream: the kernels know nothing of the package around them; the building blocks (schemes,
# algorithms, calibration, modules, architecture tables) know nothing of what assembles them; only the CLI knows it.
KERNELS = ("quantkit.kernels",)
BLOCKS = ("quantkit.quant", "quantkit.algorithms", "quantkit.calib", "quantkit.nn", "quantkit.models")
ASSEMBLY = ("quantkit.checkpoint", "quantkit.stages", "quantkit.recipe", "quantkit.presets", "quantkit.pipeline",
            "quantkit.eval", "quantkit.runtime", "quantkit.cli")  # fmt: skip


def within(module: str, parts: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in parts)


def test_imports_point_downstream():
    wrong = []
    for a, targets in GRAPH.edges.items():
        for b, lines in targets.items():
            if (
                (within(a, KERNELS) and not within(b, KERNELS))
                or (within(a, BLOCKS) and within(b, ASSEMBLY))
                or (within(b, ("quantkit.cli",)) and not within(a, ("quantkit.cli", "quantkit.__main__")))
            ):
                wrong.append(f"  {shown(GRAPH.files[a])}:{','.join(map(str, lines))} imports {b}")
    assert not wrong, "imports against the flow (kernels <- blocks <- assembly <- cli):\n" + "\n".join(wrong)


def test_the_walker_finds_loops_lazy_imports_and_private_names(tmp_path):
    """The checks above can fail: on a small package written here, a loop closed by a function-level import, a
    relative import, a private name taken from another file and a private module are each seen as described."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import run\n")
    (pkg / "_util.py").write_text("def helper():\n    return 1\n")
    (pkg / "a.py").write_text("from pkg._util import helper\n\ndef run():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..a import run\nfrom .c import _hidden, shown\n")
    (pkg / "sub" / "c.py").write_text("_hidden = shown = 1\n")
    graph = import_graph({"pkg": pkg})
    assert graph.edges["pkg"] == {"pkg.a": [1]}
    assert graph.edges["pkg.a"] == {"pkg._util": [1], "pkg.sub.b": [4]}  # the lazy import is an edge
    assert graph.edges["pkg.sub.b"] == {"pkg.a": [1], "pkg.sub.c": [2, 2]}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert f"{pkg / 'a.py'}:4 imports pkg.sub.b" in describe(graph, ["pkg.a", "pkg.sub.b"])
    assert graph.private == [("pkg.sub.b", 2, "pkg.sub.c", "_hidden")]  # a private module is not a private name


# The top-level ``kernels/`` folder must not hide Hugging Face's ``kernels`` package (a transformers >= 5.25
# dependency) when the checkout's root is on sys.path, as it is in every test run.

ROOT = Path(__file__).resolve().parents[1]


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path):
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("CUDAProperties = 'the installed package'\n")
    code = "import kernels, quantkit.kernels; print(kernels.CUDAProperties, quantkit.kernels.__name__)"
    first = [str(ROOT), str(tmp_path / "site")]  # the checkout first, as pytest puts it
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {first!r}; {code}"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["the", "installed", "package", "quantkit.kernels"]


def test_without_such_a_package_the_folder_imports_as_itself(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels; print(kernels.__file__)"
    # -S: no site-packages, so no installed ``kernels`` whatever this environment holds
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == str(ROOT / "kernels" / "__init__.py")
