"""Public model names → what answers them: embedded engines and remote upstreams ("backends"),
aliases, SemVer versions (`name`, `name@1`, `name@1.4.2`: `backends.versions`), A/B splits between
versions, and fallback chains."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.config import SamplingDefaults
from engine.types import Engine
from gateway.backends.admission import Admission
from gateway.backends.upstream import Upstream
from gateway.backends.versions import Catalog, VersionNotFound
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.protocol.openai import ModelCard, ModelList


@dataclass(slots=True)
class Backend:
    name: str
    admission: Admission
    fallback: tuple[str, ...] = ()
    engine: Engine | None = None
    upstream: Upstream | None = None
    created: int = 0
    version: str | None = None  # its SemVer version, when declared
    defaults: SamplingDefaults | None = None  # remote: sent where a request is silent (embedded: in the engine)

    async def check_health(self) -> None:
        if self.engine is not None:
            await self.engine.check_health()
        elif self.upstream is not None:
            await self.upstream.check_health()


@dataclass(slots=True)
class Split:
    name: str
    versions: list[tuple[str, float]]
    sticky: bool = False
    created: int = 0

    def choose(self, sticky_key: str | None) -> str:
        total = sum(weight for _, weight in self.versions)
        if self.sticky and sticky_key:
            digest = hashlib.sha256(f"{self.name}\0{sticky_key}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * total
        else:
            point = random.random() * total
        for name, weight in self.versions:
            if point < weight:
                return name
            point -= weight
        return self.versions[-1][0]


@dataclass(slots=True)
class ModelRegistry:
    backends: dict[str, Backend]
    splits: dict[str, Split] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    catalog: Catalog = field(default_factory=Catalog)

    def resolve(self, name: str, sticky_key: str | None = None) -> tuple[str, list[Backend]]:
        """(the version that should answer, then its fallback chain in order)."""
        canonical = self.aliases.get(name, name)
        try:
            canonical = self.catalog.lookup(canonical) or canonical
        except VersionNotFound as exc:
            raise ModelNotFound(str(exc), param="model") from exc
        split = self.splits.get(canonical)
        version = split.choose(sticky_key) if split else canonical
        if version not in self.backends:
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        return version, self._chain(version)

    def _chain(self, name: str) -> list[Backend]:
        order: list[Backend] = []

        def visit(current: str) -> None:
            backend = self.backends[current]
            if backend in order:
                return
            order.append(backend)
            for next_name in backend.fallback:
                visit(next_name)

        visit(name)
        return order

    def default_name(self, allows: Callable[..., bool] | None = None) -> str:
        """The first generating embedded model (with `allows`, a key's `KeyPolicy.allows`: the first
        the key may use), for the tokenizer and native routes when a request names none."""
        for version, backend in self.backends.items():
            engine = backend.engine
            if engine is not None and engine.info.task == "generate" and (allows is None or allows(version)):
                return version
        which = " that this key may use" if allows is not None else ""
        raise InvalidRequest(f"No embedded model is served here{which}; name one", "model")

    def engine(self, name: str | None, allows: Callable[..., bool] | None = None) -> Engine:
        """An embedded engine by public name (None: `default_name`); with `allows`, only a model the
        key may use, as the dispatcher holds every other route to them."""
        name = self.default_name(allows) if name is None else name
        version, chain = self.resolve(name)
        if allows is not None and not allows(name, version):
            raise ModelNotFound(f"The model '{name}' does not exist or you do not have access to it.", "model")
        if chain[0].engine is None:
            raise InvalidRequest(f"The model '{name}' is remote: its tokenizer is not here", "model")
        return chain[0].engine

    def engines(self) -> Iterable[tuple[str, Engine]]:
        return [(name, b.engine) for name, b in self.backends.items() if b.engine is not None]

    def listing(self) -> ModelList:
        cards = []
        for name, backend in self.backends.items():
            engine = backend.engine
            cards.append(ModelCard(
                id=name, created=backend.created, root=engine.info.root if engine else name,
                max_model_len=engine.info.max_model_len if engine else None, version=backend.version,
            ))
        for family in self.catalog.families:  # `name` alone: its newest stable version, if any
            if (newest := self.catalog.newest_stable(family)) is not None:
                cards.append(ModelCard(id=family, created=self.backends[newest].created, root=newest))
        cards += [ModelCard(id=name, created=split.created, root=name) for name, split in self.splits.items()]
        cards += [ModelCard(id=alias, created=0, root=target) for alias, target in self.aliases.items()]
        return ModelList(data=cards)
