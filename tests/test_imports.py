"""The import rules of docs/architecture.md, checked over the package's own source.

- no import circles between modules of `slurm_dlrm` (lazy imports inside functions
  count too: a circle broken only by a late import is still a circle to read);
- no module imports a `_private` name from another module;
- the floors: the pure core (`estimate/`, `packing/`, `adapt/`) imports no module that
  does I/O and nothing from the floors above it.

Imports are read with `ast`, nothing is executed. An import of a package resolves to
the submodule that defines the name when the package's `__init__` re-exports it, so
a re-export in `__init__` does not hide (or fake) a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "slurm_dlrm"

# Modules (top-level names) that do I/O or talk to an external system.
IO_MODULES = frozenset({
    "click", "subprocess", "sqlite3", "pynvml", "socket", "shutil", "requests", "urllib", "http",
    "fcntl", "signal", "multiprocessing", "threading", "asyncio", "tempfile", "jinja2", "yaml",
})
PURE_CORE = ("slurm_dlrm.estimate", "slurm_dlrm.packing", "slurm_dlrm.adapt")
# What the pure core may import from the package besides itself.
PURE_CORE_MAY_IMPORT = ("slurm_dlrm.errors", "slurm_dlrm.site", "slurm_dlrm.spec", "slurm_dlrm.presets",
                        *PURE_CORE)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
TREES: dict[str, ast.Module] = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def _reexports(pkg: str) -> dict[str, str]:
    """name -> the package module a package's `__init__` imports it from."""
    out: dict[str, str] = {}
    for node in ast.walk(TREES[pkg]):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in MODULES:
            for a in node.names:
                out[a.asname or a.name] = node.module
    return out


def _resolve(mod: str, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str) -> list[tuple[str, str | None, int]]:
    """(imported module, name taken from it or None, line) for every import in `mod`."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import):
            out.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target is None or target == "__future__":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # `from pkg import submodule`
                    out.append((sub, None, node.lineno))
                elif _is_package(target) and a.name in _reexports(target):
                    out.append((_reexports(target)[a.name], a.name, node.lineno))
                else:
                    out.append((target, a.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod in MODULES:
        for target, _name, _line in _imports(mod):
            if target in MODULES and target != mod:
                graph[mod].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    assert _circles(_graph()) == []


def test_no_module_imports_a_private_name_from_another() -> None:
    bad = [f"{MODULES[mod].relative_to(ROOT)}:{line}: {name} from {target}"
           for mod in MODULES for target, name, line in _imports(mod)
           if name and name.startswith("_") and not name.startswith("__")
           and target.startswith("slurm_dlrm") and target != mod]
    assert bad == []


@pytest.mark.parametrize("core", PURE_CORE)
def test_the_pure_core_imports_no_io_and_nothing_above_it(core: str) -> None:
    bad = []
    for mod in MODULES:
        if mod != core and not mod.startswith(core + "."):
            continue
        for target, _name, line in _imports(mod):
            where = f"{MODULES[mod].relative_to(ROOT)}:{line}: {target}"
            if target.split(".")[0] in IO_MODULES:
                bad.append(where)
            elif target.startswith("slurm_dlrm") and not any(
                    target == ok or target.startswith(ok + ".") for ok in PURE_CORE_MAY_IMPORT):
                bad.append(where)
    assert bad == []


def test_the_checker_sees_a_circle_and_a_private_import() -> None:
    """The checks above can fail: a made-up graph with a circle is caught."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from slurm_dlrm.errors import _hidden\n")
    TREES["slurm_dlrm._probe"] = tree
    MODULES["slurm_dlrm._probe"] = PKG / "_probe.py"
    try:
        assert ("slurm_dlrm.errors", "_hidden", 1) in _imports("slurm_dlrm._probe")
    finally:
        del TREES["slurm_dlrm._probe"], MODULES["slurm_dlrm._probe"]


def test_a_module_over_600_lines_says_why_at_its_top() -> None:
    """docs/architecture.md: a module past ~600 lines opens with the reason it is one module."""
    bad = []
    for mod, path in MODULES.items():
        n_lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(TREES[mod]) or ""
        if n_lines > 600 and "over 600 lines" not in doc.lower():
            bad.append(f"{path.relative_to(ROOT)}: {n_lines} lines")
    assert bad == []


# The floors of docs/architecture.md: an area (a top-level module or sub-package of
# slurm_dlrm) imports only areas on lower floors. `__main__` modules are entry points
# (they start a command) and stand above every floor.
FLOORS = {
    "slurm_dlrm": 0, "errors": 0, "presets": 0, "strict_load": 0, "package_data": 0, "osutil": 0,
    "site": 1, "spec": 1, "emulated": 1,
    "estimate": 2, "packing": 2, "adapt": 2, "slurm": 2, "agent": 2,
    "store": 3, "sim": 3, "admin": 3, "train": 3, "truth": 3,
    "localcluster": 4,
    "interference_io": 5, "service": 5, "exporter": 5, "selftest": 5,
    "commands": 6, "cli": 6,
}


def _area(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_area_has_a_floor() -> None:
    assert sorted({_area(m) for m in MODULES if not m.endswith("__main__")} - set(FLOORS)) == []


def test_areas_import_only_lower_floors() -> None:
    bad = []
    for mod, targets in _graph().items():
        if mod.endswith("__main__"):
            continue
        a = _area(mod)
        for target in targets:
            b = _area(target)
            if b != a and FLOORS.get(b, 99) >= FLOORS.get(a, -1):
                bad.append(f"{mod} (floor {FLOORS.get(a)}) -> {target} (floor {FLOORS.get(b)})")
    assert sorted(bad) == []


# The agent's one door to the emulated GPU node (slurm_dlrm/emulated/): its NVML seam
# loads the fake NVML when $SLURM_DLRM_FAKE_NVML selects it. The fake MPS daemon is
# reached as an executable on PATH, the stand-in as a member's command, never imported.
AGENT_MAY_IMPORT_EMULATED = {("slurm_dlrm.agent.nvml", "slurm_dlrm.emulated.nvml")}


def _emulated_imports_of(area: str) -> set[tuple[str, str]]:
    return {(mod, target) for mod, targets in _graph().items() if _area(mod) == area
            for target in targets if _area(target) == "emulated"}


def test_the_agent_reaches_the_emulated_node_only_through_its_nvml_seam() -> None:
    assert _emulated_imports_of("agent") - AGENT_MAY_IMPORT_EMULATED == set()


def test_the_emulated_node_imports_neither_the_simulator_nor_the_truth() -> None:
    """Its modules sit on floor 1; only the stand-in's entry point (a `__main__`) hands
    the truth in, so the fakes stay free of the simulator's internals."""
    bad = [(mod, target) for mod, targets in _graph().items()
           if _area(mod) == "emulated" and not mod.endswith("__main__")
           for target in targets if _area(target) in ("sim", "truth", "interference_io", "packing")]
    assert bad == []


def test_the_emulated_door_check_can_fail() -> None:
    """A made-up agent module importing the fake MPS daemon is caught."""
    TREES["slurm_dlrm.agent._probe"] = ast.parse("from slurm_dlrm.emulated import mps_control\n")
    MODULES["slurm_dlrm.agent._probe"] = PKG / "agent" / "_probe.py"
    try:
        assert _emulated_imports_of("agent") - AGENT_MAY_IMPORT_EMULATED == {
            ("slurm_dlrm.agent._probe", "slurm_dlrm.emulated.mps_control")}
    finally:
        del TREES["slurm_dlrm.agent._probe"], MODULES["slurm_dlrm.agent._probe"]
