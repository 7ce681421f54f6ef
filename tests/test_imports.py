"""The house's import rules, read from the source (nothing is imported): no import cycle, no
import up a floor, and no module imported by a name built at run time but in the few places
that must (``STYLE.md``: a lazy import that goes up or closes a circle means a piece lives in the
wrong place; families are found through one registry, ``recscale.families``).

Floors, bottom up: ``data`` and ``tpu_gpu_configs`` (nothing of the project), ``recscale``, the
families (``dlrm``, ``wukong``, ``baselines.*``, ``sequential``, never one another), ``sweeps``;
inside ``recscale``: the base (config, sharding, kernels, nn, metrics, flops, hlo, launch,
families), then ``optim``, ``embeddings``, ``analysis``, ``train``, ``serving``, and the commands
``export``, ``plan`` (with ``plan_report``, ``plan_tiers``), ``serve``. Function-level imports count as much as module-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "data",
    "tpu_gpu_configs",
    "recscale",
    "dlrm",
    "wukong",
    "baselines",
    "sequential",
    "sweeps",
)
FLOORS = {"data": 0, "tpu_gpu_configs": 0, "recscale": 1, "dlrm": 2, "wukong": 2}
FLOORS.update(baselines=2, sequential=2, sweeps=3)
RECSCALE_FLOORS = {
    "optim": 1,
    "embeddings": 2,
    "analysis": 3,
    "train": 4,
    "serving": 5,
    "export": 6,
    "plan": 6,
    "plan_report": 6,
    "plan_tiers": 6,
    "serve": 6,
    "population": 6,
}
# (file, function) -> why it imports a module named at run time.
DYNAMIC_IMPORTS = {
    ("recscale/families.py", "load"): "a KNOWN family's package, from the fixed table",
    ("recscale/families.py", "build_model"): "a registered family's own PACKAGE.model",
    ("sweeps/spec.py", "load_spec"): "the sweep spec named on the command line",
    ("sweeps/trial_server.py", "run_one"): "python -m MODULE in-process, argv from its worker",
}


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
TREES = {
    p: ast.parse(p.read_text(), str(p)) for p in [*MODULES.values(), *REPO.glob("benchmarks/*.py")]
}


def _target(name: str) -> str | None:
    """The project module ``name`` resolves to (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Project modules ``module`` imports anywhere in its file (``TYPE_CHECKING`` blocks aside)."""
    tree = TREES[path]
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in map(_target, names) if t is not None and t != module}
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _floor(module: str) -> tuple[int, int]:
    top, _, rest = module.partition(".")
    sub = RECSCALE_FLOORS.get(rest.partition(".")[0], 0) if top == "recscale" else 0
    return FLOORS[top], sub


def _family(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "baselines" else parts[0]


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_import_up_a_floor():
    up = []
    for a, targets in sorted(GRAPH.items()):
        for b in sorted(targets):
            if a.startswith(b + "."):  # a package's own __init__, below every module in it
                continue
            (fa, sa), (fb, sb) = _floor(a), _floor(b)
            if (fb, sb) > (fa, sa) or (fa == fb == 0 and a.split(".")[0] != b.split(".")[0]):
                up.append(f"{a} -> {b}")
            elif fa == fb == 2 and _family(a) != _family(b) and b != "baselines":
                up.append(f"{a} -> {b} (one family imports another)")
    assert not up, "\n".join(up)


class _DynamicImports(ast.NodeVisitor):
    """Calls that import a module named at run time, by (file, enclosing function)."""

    def __init__(self, file: str):
        self.file, self.function, self.found = file, "<module>", {}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_Call(self, node: ast.Call) -> None:
        name = ast.unparse(node.func).rpartition(".")[2]
        if name in ("import_module", "__import__", "spec_from_file_location", "run_module"):
            self.found[self.file, self.function] = ast.unparse(node)
        self.generic_visit(node)


def test_modules_are_imported_by_name_only_where_they_must_be():
    found = {}
    for path, tree in TREES.items():
        visitor = _DynamicImports(str(path.relative_to(REPO)))
        visitor.visit(tree)
        found.update(visitor.found)
    assert set(found) <= set(DYNAMIC_IMPORTS), found
