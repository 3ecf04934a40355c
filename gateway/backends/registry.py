"""Public model names → what answers them: embedded engines and remote upstreams ("backends"),
aliases, SemVer versions (`backends.versions`), A/B splits between versions, and fallback chains.

Which models a request can reach is one decision, `ModelRegistry.reach`: a key's `models` entries
grant concrete backends (`access`), and whatever way a request names a model (a version range, an
alias, a split, a fallback hop) it reaches only those; nothing granted is the same 404 as a model
that does not exist. `/v1/models`, the tokenizer routes and the dispatcher all ask it.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from engine.config import SamplingDefaults
from engine.types import Engine, GrammarCheck
from gateway.backends.admission import Admission
from gateway.backends.upstream import Upstream
from gateway.backends.versions import Catalog, VersionNotFound, covers
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.protocol.openai import ModelCard, ModelList


@dataclass(slots=True)
class Backend:
    name: str
    admission: Admission
    generator: Engine | Upstream  # what answers (`engine.types.Generator`): its info, generations, health
    fallback: tuple[str, ...] = ()
    grammar: GrammarCheck | None = None  # compiles structured-output constraints for the engine's model
    created: int = 0
    version: str | None = None  # its SemVer version, when declared
    defaults: SamplingDefaults | None = None  # remote: sent where a request is silent (embedded: in the engine)
    base: str | None = None  # a LoRA adapter: the model whose engine serves it (`backends.adapters`)
    identity: str = ""  # what answers under the name (`identity`): part of the response cache's key

    @property
    def engine(self) -> Engine | None:
        """The embedded engine, for what only it has (its tokenizer, load, adapters); None: remote."""
        return None if isinstance(self.generator, Upstream) else self.generator

    @property
    def healthy(self) -> bool:
        """False while its embedded engine cannot serve (read without I/O, per request); a remote
        upstream's failures come as its errors, each a fallback's cue."""
        return isinstance(self.generator, Upstream) or self.generator.healthy


def identity(**parts: object) -> str:
    """A digest of what makes a backend answer as it does (its weights, the settings that change an answer): a cached
    answer is one the backend would give now, and the same in every replica that serves the same (a shared cache)."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_plain)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _plain(value: object) -> object:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


@dataclass(slots=True)
class Split:
    name: str
    versions: list[tuple[str, float]]
    sticky: bool = False
    created: int = 0

    def choose(self, sticky_key: str | None, permitted: Callable[[str], bool] = lambda _: True) -> str | None:
        """An arm among the `permitted` ones, by weight (None: none permitted)."""
        arms = [(name, weight) for name, weight in self.versions if permitted(name)]
        if not arms:
            return None
        total = sum(weight for _, weight in arms)
        if self.sticky and sticky_key:
            digest = hashlib.sha256(f"{self.name}\0{sticky_key}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * total
        else:
            point = random.random() * total
        for name, weight in arms:
            if point < weight:
                return name
            point -= weight
        return arms[-1][0]


Access = frozenset[str] | None  # the backends a key may reach (None: every one)


@dataclass(frozen=True, slots=True)
class Reach:
    """The models one request can reach: `version` answers first, then `chain[1:]` in order."""

    version: str
    chain: list[Backend]


def not_found(name: str) -> ModelNotFound:
    return ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.", "model")


@dataclass(slots=True)
class ModelRegistry:
    backends: dict[str, Backend]
    splits: dict[str, Split] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    catalog: Catalog = field(default_factory=Catalog)
    _grants: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)

    def access(self, entries: Sequence[str] | None) -> Access:
        """The backends a key's `models` entries grant (None: no list, every model)."""
        if entries is None:
            return None
        key = tuple(entries)
        found = self._grants.get(key)
        if found is None:
            found = self._grants[key] = frozenset(name for entry in key for name in self._granted(entry))
            if len(self._grants) > 4096:  # keys-file reloads with ever new lists: keep it bounded
                self._grants.clear()
        return found

    def _granted(self, entry: str) -> Iterable[str]:
        target = self.aliases.get(entry, entry)
        if target in self.splits:
            return [arm for arm, _ in self.splits[target].versions]
        return [name for name in self.backends if covers(entry, name) or covers(target, name)]

    def reach(self, name: str, access: Access = None, sticky_key: str | None = None) -> Reach:
        """What a request for `name` reaches with `access`: the one decision (see the module)."""
        permitted = (lambda _: True) if access is None else access.__contains__
        canonical = self.aliases.get(name, name)
        try:
            canonical = self.catalog.lookup(canonical, permitted) or canonical
        except VersionNotFound as exc:  # the versions there are: for a key that may see them all
            raise (ModelNotFound(str(exc), param="model") if access is None else not_found(name)) from exc
        split = self.splits.get(canonical)
        version = split.choose(sticky_key, permitted) if split else canonical
        if version is None or version not in self.backends or not permitted(version):
            raise not_found(name)
        return Reach(version, [backend for backend in self._chain(version) if permitted(backend.name)])

    def _chain(self, name: str) -> list[Backend]:
        """`name`, then its fallbacks depth first, each once."""
        order: list[Backend] = []
        stack = [name]
        while stack:
            backend = self.backends[stack.pop()]
            if backend not in order:
                order.append(backend)
                stack += reversed(backend.fallback)
        return order

    def default_name(self, access: Access = None) -> str:
        """The first generating embedded model (the first the key may reach), for the tokenizer and
        native routes when a request names none."""
        for version, backend in self.backends.items():
            engine = backend.engine
            if engine is not None and engine.info.task == "generate" and (access is None or version in access):
                return version
        which = " that this key may use" if access is not None else ""
        raise InvalidRequest(f"No embedded model is served here{which}; name one", "model")

    def engine(self, name: str | None, access: Access = None) -> Engine:
        """The embedded engine a request for `name` reaches (None: `default_name`), for the routes
        that use a model's tokenizer."""
        name = self.default_name(access) if name is None else name
        first = self.reach(name, access).chain[0]
        if first.engine is None:
            raise InvalidRequest(f"The model '{name}' is remote: its tokenizer is not here", "model")
        return first.engine

    def engines(self) -> Iterable[tuple[str, Engine]]:
        """The engines, each once (an adapter is its base's engine)."""
        return [(name, b.engine) for name, b in self.backends.items() if b.engine is not None and b.base is None]

    def public_names(self) -> set[str]:
        return {*self.backends, *self.splits, *self.aliases, *self.catalog.families}

    def referrers(self, name: str) -> list[str]:
        """The splits and models that name `name` as a version or a fallback."""
        return sorted({*(s.name for s in self.splits.values() if any(arm == name for arm, _ in s.versions)),
                       *(b.name for b in self.backends.values() if name in b.fallback)})

    def add(self, backend: Backend) -> None:
        """A model added while serving (a LoRA adapter loaded); grants are worked out again."""
        self.backends[backend.name] = backend
        self._grants.clear()

    def remove(self, name: str) -> None:
        """A model taken away while serving (an adapter unloaded): the next request for it is a 404."""
        del self.backends[name]
        self.aliases = {alias: target for alias, target in self.aliases.items() if target != name}
        self._grants.clear()

    def listing(self, access: Access = None) -> ModelList:
        """A card for each name a request may use with `access` (one that reaches a model)."""
        cards = []
        for name, backend in self.backends.items():
            if access is not None and name not in access:
                continue
            info = backend.generator.info
            cards.append(ModelCard(id=name, created=backend.created, root=info.root or name,
                                   max_model_len=info.max_model_len or None, version=backend.version, parent=backend.base))
        for family in self.catalog.families:  # `name` alone: its newest stable version (granted), if any
            if (newest := self._reachable(family, access)) is not None:
                cards.append(ModelCard(id=family, created=self.backends[newest].created, root=newest))
        cards += [ModelCard(id=name, created=split.created, root=name) for name, split in self.splits.items()
                  if self._reachable(name, access) is not None]
        cards += [ModelCard(id=alias, created=0, root=target) for alias, target in self.aliases.items()
                  if self._reachable(alias, access) is not None]
        return ModelList(data=cards)

    def _reachable(self, name: str, access: Access) -> str | None:
        """The model a request for `name` would reach first (a split: any granted arm), or None."""
        canonical = self.aliases.get(name, name)
        split = self.splits.get(canonical)
        if split is not None:
            return next((arm for arm, _ in split.versions if access is None or arm in access), None)
        try:
            return self.reach(name, access).version
        except ModelNotFound:
            return None
