"""The layering of DESIGN.md holds (import-linter's contract in pyproject.toml), and no module of
``aisp`` imports another in a cycle, ``TYPE_CHECKING`` imports included."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_layers_contract_is_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout[-3000:]
    assert re.search(r"Contracts: [1-9]\d* kept, 0 broken", res.stdout), res.stdout[-3000:]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_cycles_even_counting_type_checking_imports() -> None:
    graph = grimp.build_graph("aisp", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = grimp.ImportGraph()
    for m in ("a", "b", "c", "d"):
        graph.add_module(m)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    """docs/ builds with mkdocs --strict: a broken link or anchor fails."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    res = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring does not count
    return (fn.end_lineno or fn.lineno) - body[0].lineno + 1


def test_functions_stay_short() -> None:
    long = []
    for path in sorted((ROOT / "src" / "aisp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _body_lines(node) > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
    assert long == []


@pytest.mark.filterwarnings("default")
def test_modules_past_500_lines_are_reported() -> None:
    """A long module is a hint, not a rule (a cap that splits files without grouping them makes
    prefixes, not rooms): it is reported in the warnings summary, and the folder rule below is
    what keeps the tree navigable."""
    big = sorted(
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in (ROOT / "src" / "aisp").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    )
    if big:
        warnings.warn(f"modules past 500 lines: {', '.join(big)}", UserWarning, stacklevel=1)


def test_no_package_folder_holds_more_than_12_modules() -> None:
    """A folder that grows past 12 modules splits into sub-packages by concept."""
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in [ROOT / "src" / "aisp", *(ROOT / "src" / "aisp").rglob("*/")]
        if folder.is_dir() and folder.name != "__pycache__"
        and (n := sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")) > 12
    }  # fmt: skip
    assert crowded == {}


def test_unit_tests_mirror_the_package_layout() -> None:
    """Each folder of tests/unit is a package of src/aisp (tests/unit/infer: aisp.infer)."""
    unit = ROOT / "tests" / "unit"
    folders = [p for p in unit.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders
    stray = [
        str(p.relative_to(unit))
        for p in folders
        if not (ROOT / "src" / "aisp" / p.relative_to(unit)).is_dir()
    ]
    assert stray == []
