"""Every setting once, as the command line (`cli`) and the configuration reference (`config_doc`) see it: one `Option`
per leaf field of the Settings classes, so a new field gets its flag and its row without a table kept by hand.

A top-level field's flag is `--field-name`, a nested one's `--group-field-name`; the engine's fields take vLLM's own
names (`--max-model-len`) unless a top-level flag has it. Secrets get no flag: a command line shows in `ps`."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.settings import Settings

ENV_PREFIX = str(Settings.model_config.get("env_prefix", ""))
ENV_DELIMITER = str(Settings.model_config.get("env_nested_delimiter", "__"))
FLATTENED = "engine"  # the group whose flags drop their prefix: vLLM's flag names
ENGINE_ARG_FLAG = "--engine-arg"
TYPE_NAMES: dict[Any, str] = {Path: "path", SecretStr: "secret", Any: "any"}  # the others: the type's own name


@dataclass(frozen=True)
class Option:
    path: tuple[str, ...]  # ("engine", "max_model_len")
    info: FieldInfo
    flag: str | None  # "--max-model-len"; None: environment only

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def group(self) -> tuple[str, ...]:
        return self.path[:-1]

    @property
    def dest(self) -> str:
        """The argparse destination: the path joined by `__`, as the environment nests it."""
        return "__".join(self.path)

    @property
    def env(self) -> str:
        return ENV_PREFIX + ENV_DELIMITER.join(self.path).upper()

    @property
    def annotation(self) -> Any:
        """The field's type without `| None`."""
        return strip_none(self.info.annotation)

    @property
    def is_bool(self) -> bool:
        return self.annotation is bool

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return get_args(self.annotation) if get_origin(self.annotation) is Literal else None

    @property
    def is_json(self) -> bool:
        """Lists and dictionaries: JSON in the environment and on the command line."""
        return get_origin(self.annotation) in (list, dict)

    @property
    def default(self) -> Any:
        if self.info.default_factory is not None:
            return self.info.default_factory()  # type: ignore[call-arg]
        return None if self.info.default is PydanticUndefined else self.info.default

    @property
    def shown_default(self) -> str:
        """The default as `--help` and the reference show it: strings as they are, other values as JSON."""
        default = self.default
        return "unset" if default is None else default if isinstance(default, str) else json.dumps(default)

    @property
    def description(self) -> str:
        return self.info.description or ""

    @property
    def type_name(self) -> str:
        """The type as the reference shows it: `int`, `float`, `path`, `"a" | "b"`, `JSON object`."""
        annotation = self.annotation
        if self.choices is not None:
            text = " | ".join(f'"{c}"' if isinstance(c, str) else str(c) for c in self.choices)
        elif self.is_json:
            text = "JSON " + ("list" if get_origin(annotation) is list else "object")
        else:
            text = TYPE_NAMES.get(annotation) or str(getattr(annotation, "__name__", annotation))
        return text + (" (optional)" if self.info.annotation is not annotation else "")


def summary(model: type[BaseModel]) -> str:
    """A settings class's docstring's first paragraph, on one line: its group's heading."""
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def strip_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        kept = [a for a in get_args(annotation) if a is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def is_secret(annotation: Any) -> bool:
    annotation = strip_none(annotation)
    return annotation is SecretStr or any(is_secret(a) for a in get_args(annotation))


def nested_model(info: FieldInfo) -> type[BaseModel] | None:
    annotation = strip_none(info.annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def groups(model: type[BaseModel] = Settings, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type[BaseModel]]]:
    """The settings classes, top first, each with its path: ((), Settings), (("limits",), LimitsSettings), ..."""
    yield prefix, model
    for name, info in model.model_fields.items():
        inner = nested_model(info)
        if inner is not None:
            yield from groups(inner, (*prefix, name))


def flag_for(path: tuple[str, ...], info: FieldInfo) -> str | None:
    if is_secret(info.annotation):
        return None
    if path == (FLATTENED, "engine_args"):
        return ENGINE_ARG_FLAG
    words = path[1:] if path[0] == FLATTENED and path[1:] and path[1] not in Settings.model_fields else path
    return "--" + "-".join(words).replace("_", "-")


def options() -> list[Option]:
    """Every leaf setting, in the order of the classes' fields, groups after the top level's fields."""
    found = []
    for prefix, model in groups():
        for name, info in model.model_fields.items():
            if nested_model(info) is None:
                path = (*prefix, name)
                found.append(Option(path, info, flag_for(path, info)))
    return found
