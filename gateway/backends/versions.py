"""Model versions (semver): a model declared with `version: 1.4.2` is served as `name@1.4.2`; `name`, `name@1` and
`name@1.4` ask for the newest stable match, a pre-release only when named exactly."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import semver

SEPARATOR = "@"
_PARTIAL = re.compile(r"^(0|[1-9]\d*)(?:\.(0|[1-9]\d*))?$")  # MAJOR or MAJOR.MINOR


class VersionNotFound(LookupError):
    """No declared version satisfies the request; the message lists those that exist."""


def model_id(name: str, version: str | None) -> str:
    return f"{name}{SEPARATOR}{version}" if version else name


def parse(version: str) -> semver.Version:
    return semver.Version.parse(version)


@dataclass(slots=True)
class Catalog:
    """The versioned models by name: name → [(version, id)], newest first."""

    families: dict[str, list[tuple[semver.Version, str]]] = field(default_factory=dict)

    def add(self, name: str, version: str) -> str:
        parsed = parse(version)
        entries = self.families.setdefault(name, [])
        if any(known == parsed for known, _ in entries):
            raise ValueError(f"model '{name}' declares version {version} twice")
        entries.append((parsed, model_id(name, version)))
        entries.sort(key=lambda entry: entry[0], reverse=True)
        return model_id(name, version)

    def lookup(self, requested: str, permitted: Callable[[str], bool] | None = None) -> str | None:
        """The id `requested` names among the `permitted` ids; None when it names no versioned model or none permitted
        (the caller decides); VersionNotFound when no version fits."""
        name, sep, wanted = requested.rpartition(SEPARATOR)
        if not sep:
            name, wanted = requested, ""
        entries = self.families.get(name)
        if entries is not None and permitted is not None:
            entries = [entry for entry in entries if permitted(entry[1])]
        if not entries:
            return None
        chosen = _choose(entries, wanted)
        if chosen is None:
            raise VersionNotFound(self._missing(requested, name, wanted))
        return chosen

    def _missing(self, requested: str, name: str, wanted: str) -> str:
        existing = ", ".join(str(version) for version, _ in reversed(self.families[name]))
        if wanted and not (_PARTIAL.match(wanted) or semver.Version.is_valid(wanted)):
            return (f"The model '{requested}' does not exist: '{wanted}' is not a version (ask for {name}, "
                    f"{name}@MAJOR, {name}@MAJOR.MINOR or {name}@MAJOR.MINOR.PATCH); {name} has versions {existing}")
        if not wanted:
            return (f"The model '{name}' has no stable version; pre-releases are served only when asked for "
                    f"exactly ({name}@VERSION); {name} has versions {existing}")
        return f"The model '{requested}' does not exist: {name} has versions {existing}"


def covers(entry: str, name: str) -> bool:
    """Whether a keys file's model entry grants the model id `name`: `assistant` every version, `assistant@1` its
    1.x.y, `assistant@1.4.2` that one only; any other entry itself."""
    if entry == name:
        return True
    family, sep, wanted = entry.partition(SEPARATOR)
    got_family, got_sep, got = name.partition(SEPARATOR)
    if got_family != family or not got_sep:
        return False
    if not sep:
        return True
    parts = wanted.split(".")
    if len(parts) >= 3 or not all(p.isdigit() for p in parts):
        return False  # an exact version: only itself (compared above)
    return got.split("+")[0].split("-")[0].split(".")[: len(parts)] == parts


def _choose(entries: list[tuple[semver.Version, str]], wanted: str) -> str | None:
    if semver.Version.is_valid(wanted):
        exact = semver.Version.parse(wanted)
        return next((id_ for version, id_ in entries if version.compare(exact) == 0), None)  # build ignored
    match = _PARTIAL.match(wanted) if wanted else None
    if wanted and match is None:
        return None
    prefix = tuple(int(part) for part in match.groups() if part is not None) if match else ()
    for version, id_ in entries:  # newest first
        if version.prerelease is None and (version.major, version.minor)[: len(prefix)] == prefix:
            return id_
    return None
