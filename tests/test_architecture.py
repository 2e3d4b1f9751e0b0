"""The layout's rules, read from the source (issue 27): no import circle, no module over 500
lines, no function over 80 lines, no getattr dispatch on built names, no /proc named outside
relocator/procs.py (and its reasoned exceptions), no hand-written deadline loop outside
relocator/waits.py (and the stdlib-only corner that runs under `python -S`).

The walker reports module-level imports (`top_imports`, run when the module loads) and
function-level ones (`lazy_imports`, run when the function does) apart. The circle test counts
both: a lazy import only hides a circle from the loader, the two modules still need each other
(issue 27 names such circles: agent/postcopy <-> pump, controller <-> backend, cluster/ <->
deploy/). Only imports under `if TYPE_CHECKING:` are left out: they never run. A second graph,
module-level imports only, adds the package `__init__`s that loading a module runs first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("relocator", "adapters")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int
    top_imports: set[str] = field(default_factory=set)
    lazy_imports: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute name an ImportFrom names (relative ones resolved against `mod`)."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if mod.path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, known: set[str]) -> str:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def _targets(mod: Module, node: ast.AST, known: set[str]) -> set[str]:
    """The tree's modules an import statement names: `from p import m` names p.m when m is a
    module, p when m is a name defined in p (packages on the way are added by the edges)."""
    if isinstance(node, ast.Import):
        names = [_owner(a.name, known) for a in node.names]
    else:
        base = _resolve(mod, node)
        names = [
            f"{base}.{a.name}" if f"{base}.{a.name}" in known else _owner(base, known)
            for a in node.names
        ]
    return {n for n in names if n and n != mod.name}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_top(mod: Module, body: list[ast.stmt], known: set[str]) -> None:
    """Module-level imports (also under if/try at top level, not under TYPE_CHECKING)."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mod.top_imports |= _targets(mod, stmt, known)
        elif isinstance(stmt, ast.If) and not _is_type_checking(stmt):
            _walk_top(mod, stmt.body + stmt.orelse, known)
        elif isinstance(stmt, ast.Try):
            handlers = [s for h in stmt.handlers for s in h.body]
            _walk_top(mod, stmt.body + handlers + stmt.orelse + stmt.finalbody, known)
        elif isinstance(stmt, ast.ClassDef):
            _walk_top(mod, stmt.body, known)


def _walk_all(mod: Module, known: set[str]) -> None:
    typing_only = {
        id(n)
        for node in ast.walk(mod.tree)
        if isinstance(node, ast.If) and _is_type_checking(node)
        for n in ast.walk(node)
    }
    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
            mod.lazy_imports |= _targets(mod, node, known)
    mod.lazy_imports -= mod.top_imports


def load_modules() -> dict[str, Module]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "reference" in path.relative_to(ROOT).parts[1:2]:
                continue  # adapters/reference: upstream code kept for comparison, not ours
            text = path.read_text()
            name = _module_name(path)
            mods[name] = Module(name, path, ast.parse(text), len(text.splitlines()))
    known = set(mods)
    for mod in mods.values():
        _walk_top(mod, mod.tree.body, known)
        _walk_all(mod, known)
    return mods


def import_edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    """Who needs whom: every import a module names, module-level and lazy."""
    return {name: (mod.top_imports | mod.lazy_imports) - {name} for name, mod in mods.items()}


def load_edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    """What runs when a module loads: its module-level imports, and the packages on their way
    (importing a.b.c runs a/__init__ and a/b/__init__ first), except the importer's own
    ancestors, already being loaded when it runs (unless it takes one of their names, which
    `_targets` reports as an edge to the package)."""
    edges = {}
    for name, mod in mods.items():
        deps = set(mod.top_imports)
        for target in mod.top_imports:
            parts = target.split(".")
            parents = {".".join(parts[:i]) for i in range(1, len(parts))}
            deps |= {p for p in parents if p in mods and not name.startswith(p + ".")}
        edges[name] = deps - {name}
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def long_functions(mods: dict[str, Module]) -> list[str]:
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{mod.name}.{node.name}:{node.lineno} {length} lines")
    return sorted(out)


def getattr_dispatch(mods: dict[str, Module]) -> list[str]:
    """getattr(x, <a name built at run time>): "prefix" + name, f-strings, .format, %."""
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
                continue
            arg = node.args[1]
            built = isinstance(arg, (ast.BinOp, ast.JoinedStr)) or (
                isinstance(arg, ast.Call)
                and isinstance(arg.func, ast.Attribute)
                and arg.func.attr == "format"
            )
            if built:
                out.append(f"{mod.name}:{node.lineno}")
    return sorted(out)


MODS = load_modules()


def test_walker_sees_both_kinds_of_import():
    """The walker itself: a known module-level import and a known lazy one are found."""
    assert "relocator.controller.model" in MODS
    assert any(m.top_imports for m in MODS.values())
    assert any(m.lazy_imports for m in MODS.values())
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    cycles = find_cycles(import_edges(MODS)) + find_cycles(load_edges(MODS))
    cycles = sorted({tuple(c) for c in cycles})
    assert not cycles, "import circles (module-level and lazy imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_module_over_500_lines():
    big = sorted(f"{m.name} {m.lines} lines" for m in MODS.values() if m.lines > MAX_MODULE_LINES)
    assert not big, "modules over 500 lines:\n" + "\n".join(big)


def test_no_function_over_80_lines():
    long = long_functions(MODS)
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_no_getattr_dispatch_on_built_names():
    hits = getattr_dispatch(MODS)
    assert not hits, "getattr on a built name:\n" + "\n".join(hits)


def _outside_deps(prefix: str) -> set[str]:
    """The tree's modules outside `prefix` (a module or a package) that `prefix` imports."""
    edges = import_edges(MODS)
    inside = [n for n in MODS if n == prefix or n.startswith(prefix + ".")]
    assert inside, prefix
    return {d for n in inside for d in edges[n] if not (d == prefix or d.startswith(prefix + "."))}


#: the shared vocabulary and helpers every part uses: below all of them, so they import only
#: each other (an import from here back up is how the circles of issue 27 began)
BOTTOM = ("relocator.choices", "relocator.vocab", "relocator.gpus", "relocator.ports",
          "relocator.waits", "relocator.procs", "relocator.paths")


def test_shared_vocabulary_is_below_its_users():
    for mod in BOTTOM:
        up = {d for d in _outside_deps(mod) if d not in BOTTOM}
        assert not up, f"{mod} imports {sorted(up)}"


def _under(deps: set[str], *parts: str) -> set[str]:
    return {d for d in deps if any(d == p or d.startswith(p + ".") for p in parts)}


def test_the_three_nevers():
    """docs/architecture.md: the planner is pure, the router never drives the controller, the
    snapshot knows no traffic."""
    planner = _outside_deps("relocator.planner")
    assert planner <= {"relocator.choices"}, sorted(planner)
    drives = _under(_outside_deps("relocator.router"), "relocator.controller", "relocator.agent",
                    "relocator.snapshot", "relocator.cell")
    assert not drives, sorted(drives)
    traffic = _under(_outside_deps("relocator.snapshot"), "relocator.router", "relocator.gateways",
                     "loadtests", "relocator.chaos", "relocator.bench")
    assert not traffic, sorted(traffic)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants of a module and its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def proc_strings(mods: dict[str, Module]) -> dict[str, list[int]]:
    """Modules whose code (not docstrings) holds a string naming /proc, with the lines."""
    out: dict[str, list[int]] = {}
    for mod in mods.values():
        docs = _docstrings(mod.tree)
        for node in ast.walk(mod.tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "/proc" in node.value and id(node) not in docs):
                out.setdefault(mod.name, []).append(node.lineno)
    return out


#: where /proc may still be named outside relocator.procs, and why
PROC_EXCEPTIONS = {
    "relocator.procs": "the process module itself",
    "relocator.cell.init": "a cell's PID 1: its own fd links and host pid, before the cell's /proc exists",
    "relocator.cell.devices": "/proc/driver/nvidia, the driver's files a GPU cell is given",
    "relocator.preflight": "checks that /proc/self/map_files is readable (CRIU needs it)",
    "relocator.agent.pump": "stdlib-only corner (runs under python -S, no psutil)",
    "relocator.agent.postcopy.base": "stdlib-only corner (the keeper's, runs under python -S)",
    # its owner's change is in flight; procs.ns_inode("net", pid) is the replacement
}


def test_no_proc_reading_outside_the_process_module():
    hits = {m: lines for m, lines in proc_strings(MODS).items() if m not in PROC_EXCEPTIONS}
    assert not hits, "/proc named outside relocator.procs (use it, or add a reasoned exception):\n" + (
        "\n".join(f"{m}: lines {lines}" for m, lines in sorted(hits.items())))
    assert set(PROC_EXCEPTIONS) - set(proc_strings(MODS)) <= set(), \
        "an exception no longer needed: drop it"


def _reads_clock(node: ast.AST) -> bool:
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
               and c.func.attr in ("monotonic", "time") and isinstance(c.func.value, ast.Name)
               and c.func.value.id == "time" for c in ast.walk(node))


def _sleeps(body: list[ast.stmt]) -> bool:
    def name(f: ast.expr) -> str | None:
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return any(isinstance(c, ast.Call) and name(c.func) == "sleep" for s in body for c in ast.walk(s))


def deadline_loops(mods: dict[str, Module]) -> list[str]:
    """`while <reads time.monotonic()/time.time()>:` loops whose body sleeps."""
    return sorted(f"{mod.name}:{node.lineno}" for mod in mods.values() for node in ast.walk(mod.tree)
                  if isinstance(node, ast.While) and _reads_clock(node.test) and _sleeps(node.body))


#: the stdlib-only corner (python -S: no tenacity) keeps its own small loops
LOOP_EXCEPTIONS = ("relocator.waits", "relocator.agent.postcopy.keeper", "relocator.agent.pump",
                   "relocator.agent.postcopy.base")


def test_no_hand_written_deadline_loop_outside_the_wait_helper():
    loops = [h for h in deadline_loops(MODS) if h.split(":")[0] not in LOOP_EXCEPTIONS]
    assert not loops, "deadline loops (use relocator.waits):\n" + "\n".join(loops)


def test_the_scanners_find_what_they_look_for():
    """The two scanners on a made-up module: a docstring mention is not a read, a loop is found."""
    src = ('"""reads /proc"""\nimport time\ndef f():\n    """/proc here too"""\n'
           '    open("/proc/meminfo")\n    t = time.monotonic() + 1\n'
           '    while time.monotonic() < t:\n        time.sleep(0.1)\n')
    mod = Module("fake", Path("fake.py"), ast.parse(src), src.count("\n"))
    assert proc_strings({"fake": mod}) == {"fake": [5]}
    assert deadline_loops({"fake": mod}) == ["fake:7"]
