"""Structured output with bounds: what may constrain an answer, checked before the engine sees it.

Two steps, both before the first byte, both refusing with a 400 that names the field the schema
came in (`response_format.json_schema.schema`, `tools.N.function.parameters`; the Responses API
says `text.format`):

1. `check_constraint` (`check_schema` on each schema), in the pipeline after `prepare` (plain Python, one walk): the size limits of
   `StructuredOutputSettings` (bytes, nesting, properties, enum values, strings, alternatives);
   every `$ref` local (`#...`) and pointing somewhere (`http:`, `https:`, `file:` and other
   external references were silently ignored by the engine's compiler: the output was then
   unconstrained there); and a finite value must exist (a schema whose required properties recur
   without end, or `{"$ref": "#"}`, would make the engine generate until max_tokens or nothing).
2. `compile_constraint`, in the pipeline after `prepare` (`pipeline.attempt`): the model's grammar compiler
   (`engine.grammar`, out of process) compiles the constraint as the engine will, within
   `compile_timeout_s`; the request's end (its client gone) stops the compile. Verdicts are kept
   per schema hash, so a schema seen before costs nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote

from engine.types import ConstraintKind, GrammarCheck, SamplingOptions
from gateway.errors import InvalidRequest, ServiceUnavailable
from gateway.settings import StructuredOutputSettings

# keywords whose value is one subschema, a map of them, or a list of them; `data` ones nest the value
_ONE = {"not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
_ONE_DATA = {"items", "additionalProperties", "additionalItems"}
_MAP = {"$defs", "definitions", "dependentSchemas"}
_MAP_DATA = {"properties", "patternProperties"}
_LISTS = {"anyOf", "oneOf", "allOf"}
MAX_JSON_NESTING = 64  # vLLM refuses deeper schemas (MAX_STRUCTURED_OUTPUT_JSON_NESTING); json.dumps would recurse
_SCALARS = {"string", "number", "integer", "boolean", "null"}
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,), "null": (type(None),),
    "object": (dict,), "array": (list,),
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What an answer is constrained to, and the request field it came from (for refusals).
    `pieces`: the schemas a client sent, each with its own field, when the constraint is made of
    several (a forced tool call among several tools); else the schema itself."""

    kind: ConstraintKind
    schema: dict[str, Any] | None
    any_whitespace: bool
    param: str
    pieces: tuple[tuple[Any, str], ...] = ()

    @property
    def spec(self) -> str:
        """The schema as JSON, as vLLM keys it (its engine core's `json.dumps`)."""
        return json.dumps(self.schema) if self.schema is not None else ""

    @classmethod
    def of(cls, sampling: SamplingOptions, param: str, pieces: tuple[tuple[Any, str], ...] = ()) -> Constraint | None:
        if sampling.json_schema is not None:
            return cls("json_schema", sampling.json_schema, not sampling.compact_json, param, pieces)
        if sampling.json_object:
            return cls("json_object", None, not sampling.compact_json, param)
        return None

    def renamed(self, rename: Callable[[str], str]) -> Constraint:
        """The same constraint with its fields as another API names them."""
        return replace(self, param=rename(self.param), pieces=tuple((schema, rename(at)) for schema, at in self.pieces))


def refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid schema for {param}: {why}", param)


@dataclass(slots=True)
class _Count:
    properties: int = 0
    enum_values: int = 0
    chars: int = 0
    alternatives: int = 0


def check_schema(schema: Any, limits: StructuredOutputSettings, param: str) -> None:
    """Refuse (400, naming `param`) a schema past the limits, with a `$ref` that is external or
    points nowhere, or that no finite JSON value satisfies."""
    if not isinstance(schema, dict):
        raise refuse(param, "a schema must be a JSON object")
    if _too_deep(schema, MAX_JSON_NESTING):
        raise refuse(param, f"its JSON nests more than {MAX_JSON_NESTING} levels deep (objects and arrays)")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_bytes:
        raise refuse(param, f"it is {size} bytes; at most {limits.max_schema_bytes} are allowed")
    count = _Count()
    nodes = []
    for node, depth, pointer in _subschemas(schema, param):
        nodes.append(node)
        if depth > limits.max_depth:
            raise refuse(param, f"{pointer} is nested {depth} levels deep; at most {limits.max_depth} are allowed")
        if isinstance(node, dict):
            _count(node, pointer, count, param)
            _check_ref(node, schema, pointer, param)
    _over(count.properties, limits.max_properties, "object properties", param)
    _over(count.enum_values, limits.max_enum_values, "enum values", param)
    _over(count.chars, limits.max_string_chars, "characters of property names, definition names, enum and const values",
          param)
    _over(count.alternatives, limits.max_alternatives, "anyOf, oneOf and allOf branches", param)
    if not Finite(schema, nodes).admits(schema):
        raise refuse(param, "no finite JSON value satisfies it (a required property, an array item or a $ref "
                            "leads back to itself without end, or a required property is not allowed)")


def _too_deep(document: Any, most: int) -> bool:
    """Whether objects and arrays nest more than `most` levels (iteratively: no recursion limit)."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > most:
                return True
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return False


def _over(value: int, most: int, what: str, param: str) -> None:
    if value > most:
        raise refuse(param, f"it has {value} {what}; at most {most} are allowed")


def _subschemas(schema: Any, param: str) -> Iterator[tuple[Any, int, str]]:
    """Every subschema (dicts and booleans) with its data nesting depth (1 at the root) and JSON
    pointer: iterative, so that a deep document cannot exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        node, depth, pointer = stack.pop()
        yield node, depth, pointer
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            nested = depth + 1 if key in _ONE_DATA or key in _MAP_DATA or key == "prefixItems" else depth
            stack.extend(_children(key, value, nested, f"{pointer}/{key}", param))


def _children(key: str, value: Any, depth: int, at: str, param: str) -> list[tuple[Any, int, str]]:
    """The subschemas under one keyword of a schema (none when the keyword holds none)."""
    if key in _ONE or key in _ONE_DATA:
        if isinstance(value, dict | bool):
            return [(value, depth, at)]
        if key == "items" and isinstance(value, list):  # draft 4-7 tuples
            return [(item, depth, f"{at}/{i}") for i, item in enumerate(value)]
    elif key in _MAP or key in _MAP_DATA:
        if isinstance(value, dict):
            return [(sub, depth, f"{at}/{name}") for name, sub in value.items()]
    elif key in _LISTS or key == "prefixItems":
        if not isinstance(value, list):
            raise refuse(param, f"{at} must be a list of schemas")
        if not value and key != "prefixItems":
            raise refuse(param, f"{at} must hold at least one schema")
        return [(item, depth, f"{at}/{i}") for i, item in enumerate(value)]
    return []


def _count(node: dict[str, Any], pointer: str, count: _Count, param: str) -> None:
    for key in ("properties", "$defs", "definitions"):
        names = node.get(key)
        if isinstance(names, dict):
            count.chars += sum(len(name) for name in names)
            count.properties += len(names) if key == "properties" else 0
    enum = node.get("enum")
    if enum is not None:
        if not isinstance(enum, list) or not enum:
            raise refuse(param, f"{pointer}/enum must be a non-empty list")
        count.enum_values += len(enum)
        count.chars += sum(len(value) for value in enum if isinstance(value, str))
    if isinstance(node.get("const"), str):
        count.chars += len(node["const"])
    count.alternatives += sum(len(node[key]) for key in _LISTS if isinstance(node.get(key), list))


def _check_ref(node: dict[str, Any], root: dict[str, Any], pointer: str, param: str) -> None:
    ref = node.get("$ref")
    if ref is None:
        return
    if not isinstance(ref, str):
        raise refuse(param, f"{pointer}/$ref must be a string")
    if not ref.startswith("#"):
        raise refuse(param, f"{pointer}/$ref is {ref[:100]!r}: only references within the schema ('#' or '#/...') "
                            "are supported, not external ones (http:, https:, file: or another document)")
    if resolve(root, ref) is None:
        raise refuse(param, f"{pointer}/$ref is {ref[:100]!r}, which points to nothing in the schema")


def resolve(root: dict[str, Any], ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/a~1b") names; None when there is none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None  # "#anchor": plain-name fragments are not supported by the engine's compiler
    node: Any = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None


class Finite:
    """Which subschemas some finite JSON value satisfies: the least fixed point, as for a grammar's
    productive symbols. Conservative: a schema is called empty only for the reasons it can see
    (required properties, items, allOf members and $refs that need themselves; a required
    property forbidden; anyOf or oneOf all of whose branches are empty; an enum none of whose
    values has the schema's type)."""

    MAX_PASSES = 64  # $ref chains resolve a link a pass at worst; past this, the rest count as satisfiable

    def __init__(self, root: dict[str, Any], nodes: list[Any]) -> None:
        self.root = root
        self.nodes = [n for n in reversed(nodes) if isinstance(n, dict)]  # children before parents, mostly
        self.done: set[int] = set()

    def admits(self, schema: Any) -> bool:
        for _ in range(self.MAX_PASSES):
            changed = False
            for node in self.nodes:
                if id(node) not in self.done and self._satisfiable(node):
                    self.done.add(id(node))
                    changed = True
            if not changed:
                return self._known(schema)
        return True

    def _known(self, node: Any) -> bool:
        return node is not False and (not isinstance(node, dict) or id(node) in self.done)

    def _satisfiable(self, node: dict[str, Any]) -> bool:
        ref = node.get("$ref")
        if isinstance(ref, str) and not self._known(resolve(self.root, ref)):
            return False
        if any(not self._known(sub) for sub in node.get("allOf") or ()):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and not any(self._known(sub) for sub in node[key]):
                return False
        types = node.get("type")
        kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
        if isinstance(node.get("enum"), list) and kinds is not None:
            return any(_has_type(value, kinds) for value in node["enum"])
        if kinds is None or kinds & _SCALARS or "enum" in node or "const" in node:
            return True
        return ("object" in kinds and self._object(node)) or ("array" in kinds and self._array(node))

    def _object(self, node: dict[str, Any]) -> bool:
        found = node.get("properties")
        properties: dict[str, Any] = found if isinstance(found, dict) else {}
        extra = node.get("additionalProperties", True)
        for name in node.get("required") or ():
            schema = properties.get(name, extra) if isinstance(name, str) else True
            if not self._known(schema):
                return False
        return True

    def _array(self, node: dict[str, Any]) -> bool:
        least = node.get("minItems", 0)
        if not isinstance(least, int) or least <= 0:
            return True
        found = node.get("prefixItems")
        prefix: list[Any] = found if isinstance(found, list) else []
        items = node.get("items", True)
        needed = [*prefix[:least], *([items] * max(0, least - len(prefix)))]
        return all(self._known(schema) for schema in needed[: len(prefix) + 1])


def _has_type(value: Any, kinds: set[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in kinds
    if isinstance(value, int) and "number" in kinds:
        return True
    if isinstance(value, float) and value.is_integer() and "integer" in kinds:
        return True
    return any(isinstance(value, _PY_TYPES.get(kind, ())) for kind in kinds)


def check_constraint(constraint: Constraint | None, limits: StructuredOutputSettings) -> None:
    """The size limits, references and finiteness of the constraint's schemas (`check_schema`)."""
    if constraint is None or constraint.schema is None:
        return
    for schema, param in constraint.pieces:
        check_schema(schema, limits, param)
    check_schema(constraint.schema, limits, constraint.param)


async def compile_constraint(
    grammar: GrammarCheck | None, constraint: Constraint | None, limits: StructuredOutputSettings
) -> None:
    """The constraint compiled on the model's grammar compiler within `compile_timeout_s`
    (waiting for a free compiler at most `compile_wait_s`: then 503); cancelled with the caller."""
    if grammar is None or constraint is None:
        return
    try:
        async with asyncio.timeout(limits.compile_wait_s + limits.compile_timeout_s):
            verdict = await grammar.check(constraint.kind, constraint.spec, constraint.any_whitespace,
                                          limits.compile_timeout_s)
    except TimeoutError:
        raise ServiceUnavailable("Every structured-output compiler is busy with new schemas: try again shortly",
                                 headers={"retry-after": "1"}) from None
    if not verdict.ok:
        raise refuse(constraint.param, f"the engine's grammar compiler refuses it: {verdict.error}")
