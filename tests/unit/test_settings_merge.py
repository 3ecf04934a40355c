"""Settings that merge (#39 item 4): a model's own block overrides only the fields it names, every other
field inherited from the global block (`settings.merged`). Checked for every field of every per-model
block, nested blocks' fields too, by walking the blocks' fields, not by example."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from engine.config import EngineSettings, SamplingDefaults
from gateway.backends import modelfile
from gateway.backends.modelfile import ModelSpec
from gateway.guards import config as guards_config
from gateway.guards.config import GuardsFile, ModerationUpstream, Profile
from gateway.settings import AdmissionSettings, merged
from tests.adapters import write_stub
from tests.fakes import fake_settings

Field = tuple[str, ...]  # a field's path through nested blocks
# values tried for a field, in order: the first a field accepts unlike its default is the global's, the next
# one unlike that (or the default: a field of two values) the model's
CANDIDATES: list[Any] = [True, False, 3, 7, 8, 16, 0.5, 0.25, "x", "y", ["a"], ["b"],
                         {"high": 0.25}, {"normal": 0.75}, {"k1": 1}, {"k2": 2}]


def _literals(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    return [value for arg in args for value in _literals(arg)]


def _nested(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def leaves(block: type[BaseModel], skip: frozenset[str] = frozenset(), path: Field = ()) -> Iterator[tuple[Field, Any, Any]]:
    """Every field of `block` (nested blocks' fields one by one) with a valid value unlike its default (the
    global's) and another one (the model's)."""
    for name, field in block.model_fields.items():
        if name in skip:
            continue
        inner = _nested(field.annotation)
        if inner is not None:
            yield from leaves(inner, frozenset(), (*path, name))
            continue
        default = getattr(block(), name)
        valid = []
        for candidate in [*_literals(field.annotation), *CANDIDATES]:
            try:
                valid.append(getattr(block.model_validate({name: candidate}), name))
            except ValidationError:
                continue
        first = next(value for value in valid if value != default)
        yield (*path, name), first, next(value for value in [*valid, default] if value != first)


def nest(path: Field, value: Any) -> dict[str, Any]:
    return {path[0]: value if len(path) == 1 else nest(path[1:], value)}


def deep_update(data: dict[str, Any], path: Field, value: Any) -> None:
    for name in path[:-1]:
        data = data.setdefault(name, {})
    data[path[-1]] = value


def read(block: BaseModel, path: Field) -> Any:
    value: Any = block
    for name in path:
        value = getattr(value, name)
    return value


Apply = Callable[[dict[str, Any], dict[str, Any]], BaseModel]  # (the global block's fields, the model's) → in effect


def _admission(global_: dict[str, Any], own: dict[str, Any]) -> BaseModel:
    return ModelSpec(name="m", admission=own).admission_settings(AdmissionSettings.model_validate(global_))


def _engine(global_: dict[str, Any], own: dict[str, Any]) -> BaseModel:
    return ModelSpec(name="m", engine=own).engine_settings(EngineSettings.model_validate(global_))


def _defaults(global_: dict[str, Any], own: dict[str, Any]) -> BaseModel:
    engine = EngineSettings(sampling_defaults=SamplingDefaults.model_validate(global_))
    return ModelSpec(name="m", defaults=own).engine_settings(engine).sampling_defaults


def _guards(global_: dict[str, Any], own: dict[str, Any]) -> BaseModel:
    file = GuardsFile(profiles={"base": Profile.model_validate(global_)}, default="base",
                      moderation=ModerationUpstream(url="http://moderation.invalid/v1"))
    profiles, by_model = guards_config.resolve(file, {"m": own})
    return profiles[by_model["m"]]


BLOCKS: list[tuple[str, type[BaseModel], Apply, frozenset[str]]] = [
    ("admission", AdmissionSettings, _admission, frozenset()),
    # the served name is the model's id, and an embedding model's task its kind: not the block's to merge
    ("engine", EngineSettings, _engine, frozenset({"served_model_name", "task"})),
    ("defaults", SamplingDefaults, _defaults, frozenset()),
    ("guards", Profile, _guards, frozenset()),
]
CASES = [pytest.param(apply, leaf, every, id=f"{name}.{'.'.join(leaf[0])}")
         for name, block, apply, skip in BLOCKS
         for every in [list(leaves(block, skip))] for leaf in every]


@pytest.mark.parametrize(("apply", "leaf", "every"), CASES)
def test_a_models_block_overrides_only_the_field_it_names(
    apply: Apply, leaf: tuple[Field, Any, Any], every: list[tuple[Field, Any, Any]]
) -> None:
    """The global block sets every field away from its default; the model's names one field: that
    field is the model's, every other one (its siblings in a nested block too) the global's."""
    path, inherited, own = leaf
    global_: dict[str, Any] = {}
    for other, value, _ in every:
        deep_update(global_, other, value)
    effective = apply(global_, nest(path, own))
    assert read(effective, path) == ({**inherited, **own} if isinstance(own, dict) else own)  # a mapping: by key
    for other, value, _ in every:
        if other != path:
            assert read(effective, other) == value, f"{'.'.join(other)} lost when the model names {'.'.join(path)}"


@pytest.mark.parametrize(("apply", "leaf", "every"), CASES)
def test_a_model_that_names_nothing_is_the_global_block(
    apply: Apply, leaf: tuple[Field, Any, Any], every: list[tuple[Field, Any, Any]]
) -> None:
    path, value, _ = leaf
    assert read(apply(nest(path, value), {}), path) == value


def test_the_issue_s_case_key_share_survives_a_models_bounds() -> None:
    spec = ModelSpec.model_validate({"name": "m", "admission": {"max_running": 4, "max_waiting": 8}})
    effective = spec.admission_settings(AdmissionSettings(key_share=0.5, queue_share={"low": 0.2, "normal": 0.9}))
    assert (effective.max_running, effective.max_waiting, effective.key_share) == (4, 8, 0.5)
    assert effective.queue_share == {"low": 0.2, "normal": 0.9}


def test_a_mapping_merges_by_key_and_a_list_is_replaced_whole() -> None:
    base = AdmissionSettings(queue_share={"low": 0.2, "normal": 0.9})
    assert merged(base, {"queue_share": {"normal": 0.5}}).queue_share == {"low": 0.2, "normal": 0.5}
    profile = Profile.model_validate({"input": {"deny": ["a"], "allow": ["b"]}})
    over = merged(profile, Profile.model_validate({"input": {"deny": ["c"]}}))
    assert (over.input.deny, over.input.allow) == (["c"], ["b"])


def test_a_bad_value_in_a_models_block_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="max_running"):
        ModelSpec.model_validate({"name": "m", "admission": {"max_running": 0}})


def test_a_models_file_as_loaded_holds_merged_admission_blocks_an_adapters_over_its_bases(tmp_path: Path) -> None:
    """Through `modelfile.load`, what the registry builds from: the issue's case, and an adapter's block
    over its base's (which is over the global one)."""
    stub = write_stub(tmp_path / "sql")
    (tmp_path / "models.yaml").write_text(
        "models:\n"
        "  - {name: base, admission: {max_running: 4, max_waiting: 8}}\n"
        "  - {name: plain}\n"
        f"  - {{name: sql, kind: adapter, base: base, path: {stub}, admission: {{max_waiting: 2}}}}\n"
    )
    settings = fake_settings(models_file=tmp_path / "models.yaml", admission={"key_share": 0.5, "retry_after_s": 7})
    specs = {spec.id: spec for spec in modelfile.load(settings).models}
    base, adapter = specs["base"].admission, specs["sql"].admission
    assert base is not None
    assert adapter is not None
    assert (base.max_running, base.max_waiting, base.key_share, base.retry_after_s) == (4, 8, 0.5, 7)
    assert (adapter.max_running, adapter.max_waiting, adapter.key_share, adapter.retry_after_s) == (4, 2, 0.5, 7)
    assert specs["plain"].admission is None  # the global block itself (backends.startup)
