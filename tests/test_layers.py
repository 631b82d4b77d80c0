"""The package's layers read bottom to top: no module imports from a layer above its own.

The order is written once, here (README "Architecture" shows it as a table). Every import
statement counts, at module level or inside a function (a lazy import is still a dependency).
The package root (``rl2gem/__init__.py``, the façade that registers the built-in envs) sits
with the envs.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top. A module belongs to the first entry that is it or one of its parents.
LAYERS = [
    (
        "foundations",
        [
            "rl2gem._lazy",
            "rl2gem.devices",
            "rl2gem.aio",
            "rl2gem.procs",
            "rl2gem.openmp",
            "rl2gem.assets",
            "rl2gem.config",
            "rl2gem.tracking",
            "rl2gem.models",
            "rl2gem.data",
        ],
    ),
    (
        "env API",
        [
            "rl2gem.core",
            "rl2gem.wrappers",
            "rl2gem.vector",
            "rl2gem.registry",
            "rl2gem.testing",
            "rl2gem.env_protocol",
            "rl2gem.remote",
        ],
    ),
    ("tools and rewards", ["rl2gem.retrieval", "rl2gem.tools", "rl2gem.rewards"]),
    ("envs", ["rl2gem.envs", "rl2gem"]),
    ("rollout", ["rl2gem.rollout"]),
    ("evaluation", ["rl2gem.evaluation"]),
    ("training core", ["rl2gem.algorithms", "rl2gem.parallel", "rl2gem.training"]),
    ("serving", ["rl2gem.serving"]),
    (
        "command lines and integrations",
        ["rl2gem.evaluate", "rl2gem.collect", "rl2gem.serve", "rl2gem.envserver", "rl2gem.integrations"],
    ),
    ("trainers", ["rl2gem.trainers"]),
]
#: Where the installed names ``rl2gem.envs`` and ``rl2gem.trainers`` live in the source tree.
SOURCES = {"rl2gem": ROOT / "rl2gem", "rl2gem.envs": ROOT / "envs", "rl2gem.trainers": ROOT / "trainers"}


def find_layer(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (the deepest matching prefix), or None."""
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


def layer_of(module: str) -> int:
    layer = find_layer(module)
    if layer is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return layer


def modules():
    """(module name, path) of every source file of the package, envs and trainers included."""
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder).with_suffix("").parts
            if package == "rl2gem" and relative[0] in ("envs", "trainers"):
                continue  # links to the two folders above, where they exist
            parts = [p for p in relative if p != "__init__"]
            yield ".".join([package, *parts]), path


def imports(module: str, path: Path):
    """The rl2gem modules ``path`` imports, with their line numbers (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            if name == "rl2gem" or name.startswith("rl2gem."):
                yield name, node.lineno


def test_every_module_is_in_a_layer():
    found = [module for module, _ in modules()]
    assert len(found) > 80 and "rl2gem.envs.math" in found and "rl2gem.trainers.ppo" in found
    assert [module for module in found if find_layer(module) is None] == []
    assert find_layer("rl2gem_other.module") is None and find_layer("rl2gem.training.forward") == 6


def test_the_readme_s_table_lists_the_layers_modules():
    """README "Architecture" names each layer's modules (``rl2gem.`` left off, a package with a
    slash); it listed fewer than the layers here after modules were added."""
    text = (ROOT / "README.md").read_text().split("## Architecture", 1)[1]
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "`" in line]
    listed = [{name.rstrip("/") for name in re.findall(r"`([\w./]+)`", modules)} for _, modules in rows]
    for (layer, modules), names in zip(LAYERS, listed, strict=True):
        short = {module.removeprefix("rl2gem.") for module in modules if module != "rl2gem"}
        missing = short - names
        assert not missing, f"README's {layer} row does not list {sorted(missing)}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in modules():
        own = layer_of(module)
        for name, line in imports(module, path):
            if layer_of(name) > own:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[own][0]}) imports {name} "
                    f"({LAYERS[layer_of(name)][0]})"
                )
    assert upward == [], "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle_between_modules():
    graph = {module: {name for name, _ in imports(module, path)} for module, path in modules()}
    known = set(graph)

    def target(name: str) -> str | None:  # ``from rl2gem.x import y`` may name a module or an object
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges = {
        m: {t for t in map(target, names) if t and t != m and not m.startswith(t + ".")} for m, names in graph.items()
    }
    # packages import their own submodules to re-export them: only cycles between non-parents count
    state, cycles = {}, []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if node.startswith(nxt + ".") or nxt.startswith(node + "."):
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]) if nxt in trail else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [("rl2gem.rollout.rollout", "rl2gem.training.forward", True), ("rl2gem.training.forward", "rl2gem.rollout", False)],
)
def test_the_checker_sees_an_upward_import(module, name, expected):
    assert (layer_of(name) > layer_of(module)) is expected


def test_no_function_is_over_120_lines():
    """The developers' guide: no function over 120 lines (a long one is a class or module waiting)."""
    long = []
    for _, path in modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 120:
                long.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                )
    assert long == [], "functions over 120 lines:\n" + "\n".join(long)
