"""The layering rules, read from the code: every import (lazy and TYPE_CHECKING ones included) of
appserver/, cron/, gateway/ and plugins/ is checked, so a wrong arrow fails the build instead of a review.

Flow: front ends (http, ws, security, cli, cron's scheduler) → runtime → agent → providers/tools →
store. docs/architecture.md points here.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support.source import parse_source

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("appserver", "cron", "gateway", "plugins")
# What the gateway child and the plugins may use of the rest: the protocol client (gateway) and the
# plugin contract and loader (gateway), the contract alone (plugins).
# appserver.sqlitewal: the stdlib-only WAL check the store and gateway.db share (one copy, not two).
GATEWAY_MAY_IMPORT = ("gateway", "appserver.client", "appserver.sqlitewal", "plugins.contract", "plugins.loader")
PLUGINS_MAY_IMPORT = ("plugins",)
# cron's data (crons.json, schedules, the run log, the lease) is below the runtime: the `schedule`
# tool uses it; cron's scheduler and its kernel adapter are a front end.
CRON_DATA = {
    "cron.store",
    "cron.pgstore",
    "cron.stores",
    "cron.schedule",
    "cron.runlog",
    "cron.lease",
    "cron.envelope",
    "cron",
}
FRONT_ENDS = (
    "appserver.http",
    "appserver.ws",
    "appserver.security",
    "appserver.cli",
    "appserver.services",
    "cron.front",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> set[str]:
    """Every module named by an import statement anywhere in the file (inside functions and
    `if TYPE_CHECKING:` blocks too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] in PACKAGES}


def all_modules() -> dict[str, set[str]]:
    """The import graph: parsed once per run (every file of four packages), a fresh copy per test."""
    return {name: set(targets) for name, targets in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, frozenset[str]]:
    return {name: frozenset(targets) for name, targets in _parse_graph().items()}


def _parse_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            graph[module_name(path)] = set()
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            name = module_name(path)
            graph[name] = {m for m in imports_of(path, name) if m in graph and m != name}
    return graph


def layer(module: str) -> str:
    """The unit a rule speaks of: `appserver.<sub>` or cron's data / front end or a top package."""
    parts = module.split(".")
    if parts[0] == "cron":
        return "cron.data" if module in CRON_DATA else "cron.front"
    if parts[0] == "appserver" and len(parts) > 1:
        return f"appserver.{parts[1]}"
    return parts[0]


FORBIDDEN: dict[str, tuple[str, ...]] = {
    # store imports nothing above it
    "appserver.store": (
        "appserver.providers",
        "appserver.agent",
        "appserver.runtime",
        *FRONT_ENDS,
        "cron.data",
        "appserver.server",
    ),
    # providers never import agent or runtime
    "appserver.providers": ("appserver.agent", "appserver.runtime", "appserver.store", *FRONT_ENDS, "appserver.server"),
    # agent never imports runtime or a front end
    "appserver.agent": ("appserver.runtime", *FRONT_ENDS, "appserver.server"),
    # runtime never imports a front end or cron
    "appserver.runtime": (*FRONT_ENDS, "cron.data", "appserver.server"),
    # cron never imports a front end of the server
    "cron.data": (
        "appserver.http",
        "appserver.ws",
        "appserver.security",
        "appserver.cli",
        "appserver.services",
        "cron.front",
        "appserver.runtime",
    ),
    "cron.front": ("appserver.http", "appserver.ws", "appserver.security", "appserver.cli", "appserver.services"),
    # the protocol client imports nothing of the server
    "appserver.client": tuple(
        f"appserver.{m.stem}"
        for m in (ROOT / "appserver").iterdir()
        if m.stem not in ("client", "__pycache__", "__init__")
    ),
}


def test_no_forbidden_direction() -> None:
    graph = all_modules()
    wrong = []
    for module, targets in graph.items():
        rules = FORBIDDEN.get(layer(module), ())
        for target in targets:
            t = layer(target)
            if t in rules:
                wrong.append(f"{module} imports {target} ({layer(module)} must not import {t})")
    assert not wrong, "\n".join(sorted(wrong))


def _within(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def test_gateway_imports_only_the_protocol_client_and_the_plugin_contract() -> None:
    graph = all_modules()
    wrong = [
        f"{m} imports {t}"
        for m, ts in graph.items()
        if m.startswith("gateway.") and m != "gateway.supervisor"
        for t in ts
        if not _within(t, GATEWAY_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(wrong)


def test_supervisor_imports_only_the_stdio_protocol() -> None:
    """The supervisor runs inside serve: it knows the child by its control lines, nothing else."""
    graph = all_modules()
    assert graph["gateway.supervisor"] <= {"gateway", "gateway.stdio"}, graph["gateway.supervisor"]


def test_plugins_import_only_the_contract() -> None:
    graph = all_modules()
    wrong = [
        f"{m} imports {t}"
        for m, ts in graph.items()
        if m.startswith("plugins")
        for t in ts
        if not _within(t, PLUGINS_MAY_IMPORT) or t.startswith("plugins.loader") and m != "plugins.loader"
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules() -> None:
    """Tarjan's strongly connected components over the module graph: any component of more than
    one module is a cycle (a package's `__init__` re-exporting its own modules is not)."""
    graph = all_modules()
    for name in graph:  # `pkg/__init__` importing `pkg.mod` is the package's public face, not a cycle
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_rules_see_real_imports() -> None:
    """The reader is not vacuous: known arrows of the flow are found."""
    graph = all_modules()
    assert "appserver.runtime" in {layer(t) for t in graph["appserver.http.chat"]}
    assert "appserver.store" in {layer(t) for t in graph["appserver.runtime.kernel"]}
    assert any(layer(t) == "appserver.runtime" for t in graph["cron.adapter"])
