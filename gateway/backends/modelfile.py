"""The models file (YAML or TOML; docs/models.md): several models in one gateway, embedded,
embedding, remote, split between versions, or LoRA adapters of an embedded base (whose LoRA
settings are derived here from its adapters). References (split versions, fallbacks, an adapter's
base) name a model or a version as clients ask for one, and are resolved to one model version at
start; everything is checked then, and a bad file is refused with a message naming the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from engine import adapters
from engine.config import EngineSettings, SamplingDefaults
from gateway.backends import versions
from gateway.guards.config import read_file
from gateway.settings import AdmissionSettings, Settings, merged


class ConfigError(ValueError):
    """The configuration cannot be served; the message says why."""


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    version: str | None = None  # SemVer: served as `name@version`
    kind: Literal["embedded", "embedding", "remote", "split", "adapter"] = "embedded"
    aliases: list[str] = Field(default_factory=list)
    fallback: list[str] = Field(default_factory=list)
    admission: AdmissionSettings | None = None
    engine: dict[str, Any] = Field(default_factory=dict)  # embedded: EngineSettings overrides
    url: str | None = None  # remote: base URL ending in /v1
    upstream_model: str | None = None  # remote: the name the upstream knows (default: name)
    api_key: str | None = None  # remote: sent as Bearer
    timeout_s: float = Field(600, gt=0)
    connect_timeout_s: float = Field(5, gt=0)
    max_connections: int = Field(256, gt=0)  # remote: connections open at once, each kept alive between requests
    versions: dict[str, float] = Field(default_factory=dict)  # split: version name → weight
    sticky: bool = False
    defaults: SamplingDefaults | None = None  # sampling defaults (embedded: over generation_config.json)
    base: str | None = None  # adapter: the embedded model whose engine serves it
    path: str | None = None  # adapter: its PEFT directory
    _lora: dict[str, Any] = PrivateAttr(default_factory=dict)  # a base: LoRA settings its adapters need

    @property
    def id(self) -> str:
        """The name this model (version) is served under: `name`, or `name@version`."""
        return versions.model_id(self.name, self.version)

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_written(cls, value: object) -> object:
        """`version: 1.4` is a number to YAML: keep it as text, to be refused as not SemVer."""
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    guards: str | dict[str, Any] | None = None  # a guard profile's name, or a profile (checked by the guards)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> ModelSpec:
        self._check_name_and_version()
        self._check_kind()
        return self

    def _check_name_and_version(self) -> None:
        for name in (self.name, *self.aliases):
            if versions.SEPARATOR in name:
                raise ValueError(f"model name or alias '{name}' has an '@': give a version as `version:`")
        if self.version is not None:
            try:
                versions.parse(self.version)
            except ValueError:
                raise ValueError(f"model '{self.name}': version '{self.version}' is not a semantic version "
                                 "(MAJOR.MINOR.PATCH, e.g. 1.4.2 or 2.0.0-rc.1)") from None
            if self.kind == "split":
                raise ValueError(f"split '{self.name}' cannot have a version: its versions are what it splits")

    def _check_kind(self) -> None:
        if self.kind == "remote" and not self.url:
            raise ValueError(f"remote model '{self.name}' needs a url")
        if self.kind == "split":
            if not self.versions:
                raise ValueError(f"split model '{self.name}' needs versions")
            if any(weight <= 0 for weight in self.versions.values()):
                raise ValueError(f"split model '{self.name}' has a weight that is not positive")
        if self.kind in ("remote", "split", "adapter") and self.engine:
            raise ValueError(f"only embedded models take engine settings ('{self.name}')")
        if self.kind == "adapter" and not (self.base and self.path):
            raise ValueError(f"adapter '{self.name}' needs a base (the model it adapts) and a path (its directory)")
        if self.kind != "adapter" and (self.base or self.path):
            raise ValueError(f"only adapters take a base and a path ('{self.name}')")

    def serve_adapters(self, lora: dict[str, Any]) -> None:
        """A base's LoRA settings, derived from the adapters it serves (`_derive_lora`)."""
        self._lora = lora

    def engine_settings(self, defaults: EngineSettings) -> EngineSettings:
        """The global engine settings with what this model's `engine` block names (nested blocks field by field)
        and its `defaults` over their sampling defaults."""
        try:
            task = {"task": "embed"} if self.kind == "embedding" else {}
            own = merged(defaults, {**self._lora, **self.engine, "served_model_name": self.id, **task})
        except ValidationError as exc:
            raise ConfigError(f"model '{self.id}': bad engine settings: {exc}") from exc
        return own.model_copy(update={"sampling_defaults": merged(own.sampling_defaults, self.defaults)})

    def admission_settings(self, defaults: AdmissionSettings) -> AdmissionSettings:
        """The global admission settings (or an adapter's base's) with what this model's `admission` names."""
        return merged(defaults, self.admission)

    @property
    def task(self) -> str | None:
        """What an engine of this entry does (None: a remote upstream or a split, not known here)."""
        if self.kind == "embedding" or (self.kind == "embedded" and self.engine.get("task") == "embed"):
            return "embed"
        return "generate" if self.kind in ("embedded", "adapter") else None


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[ModelSpec] = Field(min_length=1)


def load(settings: Settings) -> ModelsFile:
    """The models file; without one, the one embedded model of the `engine` settings, and an embedding
    model of the same weights when `embedding_model` names one."""
    if settings.models_file is None:
        models = [ModelSpec(name=settings.engine.served_model_name)]
        if settings.embedding_model:
            models.append(ModelSpec(name=settings.embedding_model, kind="embedding"))
        return ModelsFile(models=models)
    if settings.embedding_model:
        raise ConfigError("embedding_model (GATEWAY_EMBEDDING_MODEL) is for the set-up without a models file; "
                          "declare the model in the file instead (kind: embedding)")
    path = Path(settings.models_file)
    parsed = read_file(path, ModelsFile, "the models file", ConfigError)
    for spec in parsed.models:  # an adapter's relative path is the file's folder's
        if spec.path is not None:
            spec.path = str(path.parent / spec.path)
    check(parsed)
    _inherit_admission(parsed, settings.admission)
    return parsed


def _inherit_admission(models: ModelsFile, defaults: AdmissionSettings) -> None:
    """Each model's own `admission` as it holds: the global settings with what it names, an adapter's over
    its base's (which, without one of its own, shares the base's bounds)."""
    canonical = {spec.id: spec for spec in models.models}
    for spec in sorted(models.models, key=lambda spec: spec.kind == "adapter"):  # bases first
        if spec.admission is None:
            continue
        base = canonical[spec.base].admission if spec.kind == "adapter" and spec.base else None
        spec.admission = spec.admission_settings(base or defaults)


def catalog(models: ModelsFile) -> versions.Catalog:
    """The versioned models; a version declared twice is refused."""
    found = versions.Catalog()
    for spec in models.models:
        if spec.version is not None:
            try:
                found.add(spec.name, spec.version)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
    return found


def public_names(models: ModelsFile) -> set[str]:
    """Every name a client may ask for: ids (`name@version`), names (of versioned models too), aliases."""
    return {name for spec in models.models for name in (spec.id, spec.name, *spec.aliases)}


def guard_profiles(models: ModelsFile) -> dict[str, str | dict[str, Any]]:
    """Each public name (model, split, alias) → the guards its model declares; a version's by its id
    (`name@version`): the family's name is each version's, and the version that answers brings its own."""
    return {name: spec.guards for spec in models.models if spec.guards for name in (spec.id, *spec.aliases)}


def check(models: ModelsFile) -> None:
    """Names unique, references known (and resolved to one model version each), no split of
    splits, no fallback cycles."""
    versioned = catalog(models)
    names: dict[str, ModelSpec] = {}
    for spec in models.models:
        for name in (spec.id, *spec.aliases):
            if name in names or name in versioned.families:  # a versioned name is all its versions
                raise ConfigError(f"the model name or alias '{name}' is declared twice")
            names[name] = spec
    canonical = {spec.id: spec for spec in models.models}
    for spec in models.models:
        spec.fallback = [_resolve(ref, spec, canonical, versioned) for ref in spec.fallback]
        spec.versions = {_resolve(ref, spec, canonical, versioned): w for ref, w in spec.versions.items()}
        for ref in (*spec.fallback, *spec.versions):
            if spec.kind == "split" and canonical[ref].kind == "split":
                raise ConfigError(f"split '{spec.name}' cannot split into another split ('{ref}')")
    for spec in models.models:
        _one_task(spec, canonical)
        _no_cycle(spec.id, canonical, [])
    _adapters(models, canonical, versioned)


# a batch's adapter slots derived from the file: each costs memory on the device (on the CPU, max_loras
# also bounds the adapters loaded at once: engine.vllm_engine.CPU_SPARE_LORA_SLOTS)
MAX_DERIVED_LORAS = 8


def _adapters(models: ModelsFile, canonical: dict[str, ModelSpec], versioned: versions.Catalog) -> None:
    """Each adapter's base resolved to one embedded generating model, its directory read (a missing or
    malformed one refused here), and each base given the LoRA settings its adapters need."""
    ranks: dict[str, dict[str, int]] = {}  # base → its adapters' ranks, by adapter
    for spec in models.models:
        if spec.kind != "adapter":
            continue
        assert spec.base is not None
        assert spec.path is not None
        spec.base = _resolve(spec.base, spec, canonical, versioned)
        base = canonical[spec.base]
        if base.kind != "embedded" or base.task != "generate":
            raise ConfigError(f"adapter '{spec.id}': its base '{spec.base}' is not an embedded model that generates")
        try:
            found = adapters.read(spec.path)
        except adapters.AdapterError as exc:
            raise ConfigError(f"adapter '{spec.id}': {exc}") from exc
        ranks.setdefault(spec.base, {})[spec.id] = found.rank
    for name, adapter_ranks in ranks.items():
        base = canonical[name]
        highest = max(adapter_ranks.values())
        lora = {
            "enable_lora": True, "max_loras": min(len(adapter_ranks), MAX_DERIVED_LORAS),
            "max_lora_rank": adapters.rank_slot(highest), "max_cpu_loras": len(adapter_ranks),
        }
        if base.engine.get("enable_lora") is False:
            raise ConfigError(f"model '{name}' has adapters but its engine sets enable_lora: false")
        rank = base.engine.get("max_lora_rank")
        if isinstance(rank, int) and rank < highest:
            above = ", ".join(f"'{adapter}' (rank {r})" for adapter, r in adapter_ranks.items() if r > rank)
            raise ConfigError(f"model '{name}': its adapter {above} is above its max_lora_rank ({rank})")
        base.serve_adapters(lora)


def _resolve(ref: str, spec: ModelSpec, canonical: dict[str, ModelSpec], versioned: versions.Catalog) -> str:
    """A reference as the id of one model (version)."""
    try:
        found = versioned.lookup(ref)
    except versions.VersionNotFound as exc:
        raise ConfigError(f"model '{spec.id}' refers to '{ref}': {exc}") from exc
    if found is None and ref not in canonical:
        raise ConfigError(f"model '{spec.id}' refers to '{ref}', which is not declared (by its name)")
    return found or ref


def _one_task(spec: ModelSpec, specs: dict[str, ModelSpec]) -> None:
    """A model's fallbacks, or a split's versions, all generate or all embed."""
    tasks = {s.name: s.task for s in (spec, *(specs[ref] for ref in (*spec.fallback, *spec.versions)))}
    if len({task for task in tasks.values() if task is not None}) > 1:
        named = ", ".join(f"'{name}' ({task})" for name, task in tasks.items() if task is not None)
        raise ConfigError(f"model '{spec.name}' mixes models that generate and models that embed: {named}")


def _no_cycle(name: str, specs: dict[str, ModelSpec], path: list[str]) -> None:
    if name in path:
        raise ConfigError(f"the fallback chain loops: {' -> '.join([*path, name])}")
    for next_name in specs[name].fallback:
        _no_cycle(next_name, specs, [*path, name])
