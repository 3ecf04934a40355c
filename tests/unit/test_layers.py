"""The house plan, checked: which layer may import which, no import circle, no function-local
import, and vllm only behind engine/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
GATEWAY = ROOT / "gateway"
TOP = ("gateway.app", "gateway.server.cli", "gateway.server.http", "gateway.server.tls", "gateway.__main__")
CORE = {"errors", "protocol", "metrics", "context", "settings", "cache", "logs", "limits", "responses_store", "tenants",
        "quota"}
LAYERS = ("gateway.api", "gateway.serving", "gateway.backends", "gateway.middleware")

# what each layer must not import (prefixes)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "gateway.serving": ("starlette", "uvicorn", "gateway.api", "gateway.middleware", "gateway.backends", *TOP),
    "gateway.backends": ("starlette", "uvicorn", "gateway.api", "gateway.middleware", "gateway.serving", *TOP),
    "gateway.middleware": ("starlette.requests", "starlette.responses", "starlette.routing", "starlette.applications",
                           "gateway.api", "gateway.serving", "gateway.backends", *TOP),
    "gateway.api": TOP,
    "core": (*LAYERS, *TOP),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text()) for p in sorted(GATEWAY.rglob("*.py"))}


def imported(tree: ast.Module, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def layer_of(name: str) -> str:
    for layer in LAYERS:
        if name == layer or name.startswith(layer + "."):
            return layer
    if name.removeprefix("gateway.").split(".")[0] in CORE:
        return "core"
    return name


def test_each_layer_imports_only_what_it_may() -> None:
    found = modules()
    assert {layer_of(name) for name in found} >= {*LAYERS, "core"}
    broken = []
    for name, tree in found.items():
        forbidden = FORBIDDEN.get(layer_of(name), ())
        for target in imported(tree, top_level_only=False):
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                broken.append(f"{name} imports {target}")
    assert broken == []


def test_no_module_of_gateway_imports_vllm_or_torch() -> None:
    for name, tree in modules().items():
        for target in imported(tree, top_level_only=False):
            assert target.split(".")[0] not in ("vllm", "torch", "transformers"), f"{name} imports {target}"


def test_no_function_local_imports_in_gateway() -> None:
    """Every import at the top of its module: a local import hides a dependency (or a circle)."""
    for name, tree in modules().items():
        top = {id(node) for node in tree.body}
        local = [node.lineno for node in ast.walk(tree)
                 if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top]
        assert local == [], f"{name} imports inside a function or block at lines {local}"


def _graph() -> dict[str, set[str]]:
    found = modules()
    return {name: {t for t in imported(tree, top_level_only=True) if t in found and t != name}
            for name, tree in found.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    assert _cycle(_graph()) is None


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_layer_rule_catches_a_forbidden_import() -> None:
    tree = ast.parse("from starlette.requests import Request\n")
    assert "starlette.requests" in imported(tree, top_level_only=False)
    assert layer_of("gateway.serving.chat") == "gateway.serving"
    assert layer_of("gateway.errors") == "core"
    assert layer_of("gateway.protocol.openai") == "core"
