"""The house plan, checked: which layer may import which, no import circle, no function-local
import, and vllm only behind engine/."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).parents[2]
GATEWAY = ROOT / "gateway"
TOP = ("gateway.app", "gateway.server", "gateway.__main__")  # the app factory and the process: may import anything
CORE = {"errors", "settings", "protocol", "guards", "telemetry", "tenancy", "stores", "mcp"}
LAYERS = ("gateway.apis", "gateway.web", "gateway.middleware", "gateway.pipeline", "gateway.serving",
          "gateway.backends")
HTTP = ("starlette", "uvicorn")  # the web framework and the server: only the HTTP edge (EDGE)
EDGE = ("gateway.apis", "gateway.web", "gateway.middleware", "gateway.server")
UPPER = ("gateway.apis", "gateway.web", "gateway.middleware", *TOP)

# what each layer must not import (prefixes); a request runs apis → pipeline → serving → backends, and
# web/ holds the HTTP edge's shared pieces (answers, SSE, error rendering) that every API uses
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "gateway.apis": ("gateway.middleware", *TOP),
    "gateway.web": ("gateway.apis", "gateway.middleware", *TOP),
    # the middleware renders errors (web.error_render) and fills the request's context (pipeline.context)
    "gateway.middleware": ("starlette.requests", "starlette.responses", "starlette.routing", "starlette.applications",
                           "gateway.apis", "gateway.web.answers", "gateway.web.sse",
                           "gateway.pipeline.dispatch", "gateway.pipeline.attempt", "gateway.serving",
                           "gateway.backends", *TOP),
    "gateway.pipeline": (*HTTP, *UPPER),
    "gateway.serving": (*HTTP, *UPPER, "gateway.pipeline", "gateway.backends"),
    "gateway.backends": (*HTTP, *UPPER, "gateway.pipeline", "gateway.serving"),
    "core": (*HTTP, *LAYERS, *TOP),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _parsed() -> tuple[tuple[str, ast.Module], ...]:
    """Every module of gateway/ parsed once for the file's tests (seconds each time on this machine; they only read
    the trees)."""
    return tuple((module_name(p), ast.parse(p.read_text())) for p in sorted(GATEWAY.rglob("*.py")))


def modules() -> dict[str, ast.Module]:
    return dict(_parsed())


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


def test_the_top_holds_the_app_factory_settings_errors_and_main_only() -> None:
    loose = sorted(p.name for p in GATEWAY.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "app.py", "errors.py", "settings.py"]
    assert all(layer_of(name) in (*LAYERS, "core") or name.startswith(TOP) for name in modules() if name != "gateway")


def test_only_the_http_edge_imports_the_web_framework() -> None:
    """Starlette and uvicorn only at the HTTP edge: the pipeline and below are plain Python."""
    found = sorted(name for name, tree in modules().items()
                   if any(t.split(".")[0] in HTTP for t in imported(tree, top_level_only=False))
                   and not name.startswith(EDGE))
    assert found == []


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


# The one kind of local import allowed, each named here: a module of an optional extra, imported only
# where the configuration chooses it (the gateway imports and runs without the extra installed).
OPTIONAL_EXTRAS = {("gateway.stores.backends", "gateway.stores.blobs_s3")}  # the `s3` extra (boto3)


def _for_the_type_checker(tree: ast.Module) -> list[ast.stmt]:
    """The statements of the module's top-level `if TYPE_CHECKING:` blocks (types of an optional extra's
    stubs, never imported at run time)."""
    return [node for block in tree.body
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for node in block.body]


def test_no_function_local_imports_in_gateway() -> None:
    """Every import at the top of its module: a local import hides a dependency (or a circle)."""
    for name, tree in modules().items():
        top = {id(node) for node in [*tree.body, *_for_the_type_checker(tree)]}
        local = [node.lineno for node in ast.walk(tree)
                 if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top
                 and not (isinstance(node, ast.ImportFrom) and (name, node.module) in OPTIONAL_EXTRAS)]
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
                return [*path[path.index(nxt):], nxt]
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
    assert layer_of("gateway.apis.chat.chat_serving") == "gateway.apis"
    assert layer_of("gateway.serving.generation") == "gateway.serving"
    assert layer_of("gateway.guards.stream") == "core"
    assert layer_of("gateway.pipeline.dispatch") == "gateway.pipeline"
    assert layer_of("gateway.stores.cache") == "core"
    assert layer_of("gateway.errors") == "core"
    assert layer_of("gateway.protocol.openai") == "core"


def test_no_module_name_repeats_in_gateway() -> None:
    """One name, one module: a name found in a traceback or a grep says which file it is."""
    names = sorted(p.name for p in GATEWAY.rglob("*.py") if p.name != "__init__.py")
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_an_api_package_names_its_modules_after_itself() -> None:
    """gateway/apis/<api>/<api>_routes.py, <api>_serving.py, <api>_wire.py: the convention that keeps names apart."""
    strays = [str(p.relative_to(GATEWAY)) for p in GATEWAY.glob("apis/*/*.py")
              if p.name != "__init__.py" and not p.stem.startswith(p.parent.name + "_")]
    assert strays == []


# who may write the request's record (the access line's): the HTTP edge and the pipeline; below it,
# a generation reports what it measured as values (`serving.meter.Readings`) the pipeline reports
RECORD_WRITERS = ("gateway.middleware", "gateway.web", "gateway.pipeline", "gateway.telemetry", *TOP)
RECORD_NAMES = {"current_record", "RequestRecord", "open_record"}


def _reaches_the_record(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == "gateway.telemetry.record"
               and any(alias.name in RECORD_NAMES for alias in node.names) for node in ast.walk(tree))


def test_nothing_below_the_pipeline_reaches_the_request_record() -> None:
    reaching = sorted(name for name, tree in modules().items()
                      if _reaches_the_record(tree) and not name.startswith(RECORD_WRITERS)
                      and not name.endswith("_routes") and not name.startswith(("gateway.apis.batches.batches_line", "gateway.apis.takeover")))
    assert reaching == []


def test_the_record_rule_sees_an_import() -> None:
    assert _reaches_the_record(ast.parse("from gateway.telemetry.record import current_record"))
    assert not _reaches_the_record(ast.parse("from gateway.telemetry.record import current_trace"))
