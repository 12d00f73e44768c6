"""The house's structure, held by a test: the floors of the packages, no import circles, no recipe of algorithms/
importing another's modules, Ray only in cluster/, no module over 450 lines, no function over 80 but those named with
their reason. Every import counts: at module level, in a function (deferred, it still ties the two modules) and under
`if TYPE_CHECKING:` (it ties the design), and so does a `"reinforge.module:attribute"` string imported by name
(recipes/stages.py). Each rule is a function from the parsed modules to its violations, so the tests below also plant
one violation of each kind and check that the rule sees it (test_tracked_files.py holds the rule on tracked files)."""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The floors, lowest first. A unit is a subpackage of reinforge/ or a module directly in it; every unit has a floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    # 0, the ground: the exception types users see, where the package's own files lie, and the config machinery
    # (Section, the YAML loader, overrides, `defaults:` inheritance) that every component's config class is built on.
    # No component's section lives here: a section sits beside its component, a recipe's root tree at the top.
    ("errors", "paths", "config"),
    # 1, utilities with no knowledge of RL: the run directory (atomic writes, run layout), HTTP exposure and guards
    # (network.py), model loading with its `model:` section (modeling.py, model_config.py), deadlines, hang
    # reports and the step watchdog (hang.py), and how a run's process ends: its exit status, its last line, its
    # heartbeat (exits.py).
    ("run_dir", "network", "model_config", "modeling", "hang", "exits"),
    # 2, what a run reads and writes: records, batches and chat rendering (data/), environments that score
    # conversations (envs/), and metric names, loggers and reports (logging/, which reads the run's JSONL via data/).
    ("data", "envs", "logging"),
    # 3, the two backends: generating tokens (generation/) and computing logprobs and training on a batch (training/).
    ("generation", "training"),
    # 4, components built from the backends: Ray worker groups (cluster/), rollouts across turns and environments
    # (rollout/), the OpenAI-compatible policy server (serving/), agents that call it (agents/), evaluation.
    # The subcommand modules envs/cli.py, serving/cli.py and evaluation/cli.py import only their own floor and
    # below, so they stay in their packages.
    ("cluster", "rollout", "serving", "agents", "evaluation"),
    # 5, the algorithms as a paper states them: each recipe (GRPO, PPO, distillation, SFT, DPO, RM) with its config,
    # its step, its losses and advantages, and the math they share. A recipe never runs itself.
    ("algorithms",),
    # 6, the loops that run the recipes (the RL loop, the supervised loop) and their machinery: building a run's
    # parts from config, checkpoints and resume, refit, the run's checks, the table of recipes; and the Tinker
    # service, which drives the same training backend and engines from a remote user's loop.
    ("loops", "tinker"),
    # 7, the front doors: multi-stage recipes, the command line and the supervisor that restarts a failed run.
    ("recipes", "cli", "supervisor"),
)
FLOOR_OF = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}

# Imports that climb from a lower floor to a higher one: (importer module, imported module, why), at most three.
ALLOWED_CLIMBS: tuple[tuple[str, str, str], ...] = ()
MAX_ALLOWED_CLIMBS = 3

# The recipes of algorithms/. A module is a recipe's when its name is the recipe's or starts with it and "_" (grpo.py,
# grpo_config.py, grpo_losses.py); what recipes share (losses.py, advantages.py, shaping.py, ...) is no recipe's.
RECIPES = ("grpo", "ppo", "distill", "sft", "dpo", "rm")

MAX_MODULE_LINES = 450

# A function's lines count from its `def` to its last line; a nested function counts inside its parent and on its own.
MAX_FUNCTION_LINES = 80
# The functions allowed over MAX_FUNCTION_LINES: {"module:qualified name": why}, at most five.
LONG_FUNCTIONS: dict[str, str] = {
    "reinforge.envs.sandbox_supervisor:supervise": "shipped as one self-contained source to a fresh interpreter, "
    "so its helpers are nested in it",
}
MAX_LONG_FUNCTIONS = 5


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module of the package, or the top-level name of another distribution ("ray")
    line: int
    type_only: bool

    def __str__(self) -> str:
        kind = " (type-only)" if self.type_only else ""
        return f"{self.importer}:{self.line} imports {self.imported}{kind}"


@dataclass(frozen=True)
class Module:
    name: str  # reinforge.data.batch
    num_lines: int
    imports: list[Import]
    function_lines: dict[str, int]  # qualified name ("Class.method", "outer.inner") -> lines from `def` to its end


def module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse_modules(sources: dict[str, str]) -> dict[str, Module]:
    """Modules from {path relative to the repository root: source}."""
    names = {module_name(Path(path)) for path in sources}
    modules = {}
    for path, source in sources.items():
        name = module_name(Path(path))
        tree = ast.parse(source)
        imports = imports_of(name, path.endswith("__init__.py"), tree, names)
        modules[name] = Module(name, len(source.splitlines()), imports, function_lines(tree))
    return modules


def function_lines(tree: ast.Module) -> dict[str, int]:
    """Every function's and method's number of lines, from its `def` to its last line, by qualified name."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def load_modules(root: Path) -> dict[str, Module]:
    """Every module of the package whose directory is `root`."""
    return parse_modules({str(p.relative_to(root.parent)): p.read_text() for p in sorted(root.rglob("*.py"))})


@cache
def package() -> dict[str, Module]:
    return load_modules(REPO / "reinforge")


def _resolve(dotted: str, modules: set[str]) -> str:
    """The longest prefix of `dotted` that is a module of the package; else the top-level name."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def imports_of(name: str, is_package: bool, tree: ast.Module, modules: set[str]) -> list[Import]:
    """What module `name` (an __init__.py if `is_package`) imports, each resolved against the package's `modules`."""
    found = []

    def add(dotted: str, node: ast.AST, type_only: bool) -> None:
        found.append(Import(name, _resolve(dotted, modules), node.lineno, type_only))

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}", node, type_only)  # `from pkg import submodule` imports the submodule
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"reinforge(\.\w+)+:\w+", node.value):  # imported by name with importlib
                add(node.value.split(":")[0], node, type_only)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def internal_imports(modules: dict[str, Module]) -> list[Import]:
    """Imports between two modules of the package; a module importing its own package's __init__ is left out."""
    return [
        imp
        for module in modules.values()
        for imp in module.imports
        if imp.imported in modules and imp.imported != imp.importer and not imp.importer.startswith(imp.imported + ".")
    ]


def unit_of(name: str) -> str:
    """reinforge.data.batch -> data; reinforge.cli -> cli. The package's own __init__ (its version) has no unit."""
    return name.split(".")[1] if "." in name else ""


def units_without_floor(modules: dict[str, Module], floor_of: dict[str, int]) -> list[str]:
    units = {unit_of(name) for name in modules} - {""}
    return [f"{unit} has no floor in FLOORS" for unit in sorted(units - floor_of.keys())] + [
        f"FLOORS names {unit}, which is not in the package" for unit in sorted(floor_of.keys() - units)
    ]


def climbing_imports(
    modules: dict[str, Module], floor_of: dict[str, int], allowed: tuple[tuple[str, str, str], ...]
) -> list[str]:
    """Imports from a lower floor to a higher one not in `allowed`, and entries of `allowed` that no longer climb."""
    climbs = {}
    for imp in internal_imports(modules):
        low, high = floor_of.get(unit_of(imp.importer)), floor_of.get(unit_of(imp.imported))
        if low is not None and high is not None and low < high:
            climbs.setdefault((imp.importer, imp.imported), f"{imp} (floor {low} -> {high})")
    permitted = {(importer, imported) for importer, imported, _ in allowed}
    return [message for pair, message in sorted(climbs.items()) if pair not in permitted] + [
        f"ALLOWED_CLIMBS lists {importer} -> {imported}, which does not climb (any more): remove it"
        for importer, imported in sorted(permitted - climbs.keys())
    ]


def import_circles(modules: dict[str, Module]) -> list[str]:
    """Each strongly connected component of the module graph with more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in internal_imports(modules):
        graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                circles.append("import circle: " + " <-> ".join(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(circles)


def recipe_of(name: str) -> str | None:
    """reinforge.algorithms.grpo_losses -> grpo; a module no recipe owns -> None."""
    if not name.startswith("reinforge.algorithms."):
        return None
    leaf = name.split(".")[2]
    return next((recipe for recipe in RECIPES if leaf == recipe or leaf.startswith(recipe + "_")), None)


def cross_recipe_imports(modules: dict[str, Module]) -> list[str]:
    """Imports from one recipe's module to another recipe's: what two recipes share belongs to neither."""
    return [
        f"{imp}: recipe {importer} imports recipe {imported}'s module"
        for imp in internal_imports(modules)
        if (importer := recipe_of(imp.importer)) and (imported := recipe_of(imp.imported)) and importer != imported
    ]


def ray_outside_cluster(modules: dict[str, Module]) -> list[str]:
    return [
        str(imp)
        for module in modules.values()
        if not module.name.startswith("reinforge.cluster")
        for imp in module.imports
        if imp.imported == "ray"
    ]


def long_modules(modules: dict[str, Module], max_lines: int = MAX_MODULE_LINES) -> list[str]:
    return [
        f"{name} has {module.num_lines} lines (at most {max_lines})"
        for name, module in sorted(modules.items())
        if module.num_lines > max_lines
    ]


def long_functions(
    modules: dict[str, Module], allowed: dict[str, str], max_lines: int = MAX_FUNCTION_LINES
) -> list[str]:
    """Functions over `max_lines` lines not in `allowed`, and entries of `allowed` that are no longer over."""
    long = {
        f"{name}:{function}": lines
        for name, module in modules.items()
        for function, lines in module.function_lines.items()
        if lines > max_lines
    }
    return [
        f"{key} has {lines} lines (at most {max_lines})" for key, lines in sorted(long.items()) if key not in allowed
    ] + [
        f"LONG_FUNCTIONS lists {key}, which is not over {max_lines} lines (any more): remove it"
        for key in sorted(allowed.keys() - long.keys())
    ]


# The rules on the package as it is; a failure lists its violations, one a line.
_report = "\n".join


def test_every_unit_of_the_package_has_a_floor():
    assert not (problems := units_without_floor(package(), FLOOR_OF)), _report(problems)


def test_no_module_imports_one_on_a_higher_floor():
    assert not (problems := climbing_imports(package(), FLOOR_OF, ALLOWED_CLIMBS)), _report(problems)


def test_each_allowed_climb_names_its_reason_and_there_are_few():
    assert len(ALLOWED_CLIMBS) <= MAX_ALLOWED_CLIMBS
    assert all(len(reason.split()) >= 3 for _, _, reason in ALLOWED_CLIMBS)


def test_no_import_circles_counting_deferred_and_type_only_imports():
    assert not (problems := import_circles(package())), _report(problems)


def test_no_recipe_imports_another_recipes_module():
    assert not (problems := cross_recipe_imports(package())), _report(problems)


def test_ray_is_imported_only_in_cluster():
    assert not (problems := ray_outside_cluster(package())), _report(problems)


def test_no_module_is_over_450_lines():
    assert not (problems := long_modules(package())), _report(problems)


def test_no_function_is_over_80_lines_but_the_named_exceptions():
    assert not (problems := long_functions(package(), LONG_FUNCTIONS)), _report(problems)


def test_each_long_function_names_its_reason_and_there_are_few():
    assert len(LONG_FUNCTIONS) <= MAX_LONG_FUNCTIONS
    assert all(len(reason.split()) >= 3 for reason in LONG_FUNCTIONS.values())


# Each rule sees a violation planted in a synthetic package.

FLOORS_AB = {"low": 0, "high": 1}
TYPE_CHECKING_BLOCK = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"


def test_an_upward_import_is_reported_at_module_level_in_a_function_and_type_only():
    modules = parse_modules(
        {
            "reinforge/high/top.py": "",
            "reinforge/low/a.py": "from reinforge.high.top import thing\n",
            "reinforge/low/b.py": "def f():\n    from reinforge.high import top\n",
            "reinforge/low/c.py": TYPE_CHECKING_BLOCK + "    import reinforge.high.top\n",
            "reinforge/low/d.py": "NAME = 'reinforge.high.top:thing'\n",
            "reinforge/high/ok.py": "from reinforge.low.a import x\n",
        }
    )
    assert climbing_imports(modules, FLOORS_AB, ()) == [
        "reinforge.low.a:1 imports reinforge.high.top (floor 0 -> 1)",
        "reinforge.low.b:2 imports reinforge.high.top (floor 0 -> 1)",
        "reinforge.low.c:4 imports reinforge.high.top (type-only) (floor 0 -> 1)",
        "reinforge.low.d:1 imports reinforge.high.top (floor 0 -> 1)",
    ]


def test_an_allowed_climb_passes_and_a_stale_allowance_is_reported():
    modules = parse_modules({"reinforge/high/top.py": "", "reinforge/low/a.py": "import reinforge.high.top\n"})
    allowed = (("reinforge.low.a", "reinforge.high.top", "planted for the test"),)
    assert climbing_imports(modules, FLOORS_AB, allowed) == []
    stale = allowed + (("reinforge.low.b", "reinforge.high.top", "no longer imported"),)
    assert climbing_imports(modules, FLOORS_AB, stale) == [
        "ALLOWED_CLIMBS lists reinforge.low.b -> reinforge.high.top, which does not climb (any more): remove it"
    ]


def test_a_unit_missing_from_the_floors_is_reported():
    modules = parse_modules({"reinforge/low/a.py": "", "reinforge/extra.py": ""})
    assert units_without_floor(modules, FLOORS_AB) == [
        "extra has no floor in FLOORS",
        "FLOORS names high, which is not in the package",
    ]


def test_an_import_circle_through_a_type_only_import_is_reported():
    modules = parse_modules(
        {
            "reinforge/x/__init__.py": "",
            "reinforge/x/a.py": "from . import b\n",
            "reinforge/x/b.py": TYPE_CHECKING_BLOCK + "    from reinforge.x.c import C\n",
            "reinforge/x/c.py": "def f():\n    from .a import g\n",
            "reinforge/x/d.py": "from reinforge.x import a\nimport reinforge.x\n",
        }
    )
    assert import_circles(modules) == ["import circle: reinforge.x.a <-> reinforge.x.b <-> reinforge.x.c"]


def test_a_recipe_importing_another_recipes_module_is_reported_and_shared_math_is_not():
    modules = parse_modules(
        {
            "reinforge/algorithms/shaping.py": "",
            "reinforge/algorithms/grpo_config.py": "from reinforge.algorithms.shaping import OverlongConfig\n",
            "reinforge/algorithms/grpo.py": "from reinforge.algorithms.grpo_config import GRPORunConfig\n",
            "reinforge/algorithms/ppo_config.py": "def f():\n    from reinforge.algorithms import grpo_config\n",
        }
    )
    assert cross_recipe_imports(modules) == [
        "reinforge.algorithms.ppo_config:2 imports reinforge.algorithms.grpo_config: recipe ppo imports recipe grpo's "
        "module"
    ]


def test_ray_in_a_data_module_is_reported_and_in_cluster_is_not(tmp_path):
    """Planted in a copy of the real data/ and cluster/, read from disk as the rule reads the package."""
    for unit in ("data", "cluster"):
        shutil.copytree(
            REPO / "reinforge" / unit, tmp_path / "reinforge" / unit, ignore=shutil.ignore_patterns("*.pyc")
        )
    (tmp_path / "reinforge/data/planted.py").write_text('"""Planted."""\n\nimport ray.util\n')
    (tmp_path / "reinforge/cluster/planted.py").write_text("import ray\n")
    assert ray_outside_cluster(load_modules(tmp_path / "reinforge")) == ["reinforge.data.planted:3 imports ray"]


def test_a_500_line_module_is_reported():
    modules = parse_modules({"reinforge/data/long.py": "x = 1\n" * 500, "reinforge/data/ok.py": "x = 1\n" * 450})
    assert long_modules(modules) == ["reinforge.data.long has 500 lines (at most 450)"]


def test_a_long_function_is_reported_nested_or_not_unless_allowed_and_a_stale_allowance_too():
    body, nested = "    x = 1\n", "        x = 1\n"
    source = (
        "def short():\n" + body * 80  # 81 lines
        + "class Engine:\n    def start(self):\n" + nested * 79  # 80 lines: at the floor
        + "def outer():\n    def inner():\n" + nested * 80 + "    return inner\n"  # inner 81, outer 83
        + "def allowed():\n" + body * 90
    )  # fmt: skip
    modules = parse_modules({"reinforge/data/long.py": source})
    assert modules["reinforge.data.long"].function_lines == {
        "short": 81, "Engine.start": 80, "outer": 83, "outer.inner": 81, "allowed": 91
    }  # fmt: skip
    allowed = {"reinforge.data.long:allowed": "planted for the test", "reinforge.data.long:gone": "no longer long"}
    assert long_functions(modules, allowed) == [
        "reinforge.data.long:outer has 83 lines (at most 80)",
        "reinforge.data.long:outer.inner has 81 lines (at most 80)",
        "reinforge.data.long:short has 81 lines (at most 80)",
        "LONG_FUNCTIONS lists reinforge.data.long:gone, which is not over 80 lines (any more): remove it",
    ]
