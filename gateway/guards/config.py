"""The guards file (YAML or TOML; docs/tenants-and-guards.md): named guard profiles (input and output checks), which one
a request gets (`default`, per API key `keys`, or a model's `guards:` in the models file, by name or inline), and the
moderation upstream. Everything is checked at start: a bad pattern or an unknown profile is refused with a message
naming it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from gateway.settings import merged

Action = Literal["off", "flag", "redact", "block"]
Verdict = Literal["off", "flag", "block"]  # for checks that find no span to redact (injection, moderation)
FileT = TypeVar("FileT", bound=BaseModel)


class GuardConfigError(ValueError):
    """The guards configuration cannot be served; the message says why."""


def _compiles(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"the pattern {pattern!r} is not a valid regular expression: {exc}") from exc
    return pattern


Regex = Annotated[str, AfterValidator(_compiles)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PatternRule(_Strict):
    """A deny pattern with its own action; a bare string in `deny` is one that blocks."""

    pattern: Regex
    action: Literal["flag", "redact", "block"] = "block"
    name: str = Field("deny", pattern=r"^[a-z][a-z0-9_.-]*$", description="the guard's name in metrics and logs")


class PIIChecks(_Strict):
    email: Action = "off"
    phone: Action = "off"
    card: Action = "off"  # 13 to 19 digits that pass the Luhn check
    iban: Action = "off"  # country format and the mod-97 check
    ip: Action = "off"  # IPv4 and IPv6 addresses
    phone_region: str | None = Field("US", description="how to read numbers written without +country code")


class SecretChecks(_Strict):
    """Secrets found by detect-secrets' plugins (gateway/guards/secrets.py), per kind; `secrets: block` (or flag,
    redact) sets every kind at once."""

    aws: Action = "off"  # access key ids, and secret keys written beside an "aws ... key"
    google: Action = "off"  # API keys (AIza...), OAuth client secrets
    azure: Action = "off"  # storage account keys, AD client secrets
    github: Action = "off"
    gitlab: Action = "off"
    slack: Action = "off"  # tokens and webhook URLs
    stripe: Action = "off"
    openai: Action = "off"
    anthropic: Action = "off"
    private_key: Action = "off"  # PEM blocks (RSA, EC, DSA, OpenSSH, PGP, PKCS#8) and PuTTY keys
    jwt: Action = "off"
    other: Action = "off"  # detect-secrets' other token plugins: npm, PyPI, SendGrid, Twilio, Discord, ...
    high_entropy: Action = "off"  # a high-entropy value assigned to a key: key=value, "key": "value"
    keyword: Action = "off"  # any quoted value of a secret-named key: password = "...", "api_key": "..."

    @model_validator(mode="before")
    @classmethod
    def _every_kind(cls, value: Any) -> Any:
        return dict.fromkeys(cls.model_fields, value) if isinstance(value, str) else value


class Checks(_Strict):
    deny: list[Regex | PatternRule] = Field(default_factory=list)
    allow: list[Regex] = Field(default_factory=list, description="spans matching these are exempt from the checks")
    injection: Verdict = "off"
    pii: PIIChecks = Field(default_factory=PIIChecks)
    moderation: Verdict = "off"

    def rules(self) -> list[PatternRule]:
        return [PatternRule(pattern=r) if isinstance(r, str) else r for r in self.deny]


class InputChecks(Checks):
    max_chars: int | None = Field(None, gt=0, description="most characters of prompt text a request may send")
    max_tokens: int | None = Field(None, gt=0, description="most prompt tokens a request may send")
    restore: bool = Field(True, description="put redacted values back where the answer repeats their placeholders")
    secrets: SecretChecks = Field(default_factory=SecretChecks)


class OutputChecks(Checks):
    holdback_chars: int = Field(
        32, ge=0, description="streams: text kept back until this much follows it, so a match is caught whole"
    )
    window_chars: int = Field(256, ge=0, description="streams: text already sent that matches may still span")
    moderation_chars: int = Field(400, gt=0, description="streams: moderate the answer every this many characters")


class Profile(_Strict):
    input: InputChecks = Field(default_factory=InputChecks)
    output: OutputChecks = Field(default_factory=OutputChecks)

    def moderates(self) -> bool:
        return self.input.moderation != "off" or self.output.moderation != "off"


class ModerationUpstream(_Strict):
    url: str = Field(description="base URL of an OpenAI-compatible API, ending in /v1")
    model: str | None = Field(None, description="sent as `model` when set")
    api_key: SecretStr | None = None
    timeout_s: float = Field(2, gt=0)
    fail: Literal["open", "closed"] = Field("open", description="open: serve when it fails; closed: refuse")


class GuardsFile(_Strict):
    profiles: dict[str, Profile] = Field(default_factory=dict)
    default: str | None = None
    keys: dict[str, str] = Field(default_factory=dict, description="API key id → profile")
    moderation: ModerationUpstream | None = None


ModelGuards = dict[str, str | dict[str, Any]]  # public model name → a profile's name, or a profile inline


def read_file(path: Path, kind: type[FileT], what: str, error: type[ValueError]) -> FileT:
    """A configuration file (TOML by its suffix, else YAML) as `kind`; `error` names what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        return kind.model_validate((tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)) or {})
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise error(f"{what} {path} is not valid {path.suffix[1:].upper() or 'YAML'}: {exc}") from exc
    except ValidationError as exc:
        raise error(f"{what} {path} is not valid: {exc}") from exc


def read(path: Path | None) -> GuardsFile:
    return GuardsFile() if path is None else read_file(Path(path), GuardsFile, "the guards file", GuardConfigError)


def resolve(config: GuardsFile, models: ModelGuards) -> tuple[dict[str, Profile], dict[str, str]]:
    """Every profile by name (the models' inline ones as `model:<name>`: the default profile with what they name),
    and each model's profile name; unknown names and moderation without an upstream are refused."""
    profiles = dict(config.profiles)
    inherited = profiles.get(config.default or "") or Profile()  # an unknown default is refused below
    by_model: dict[str, str] = {}
    for model, ref in models.items():
        if isinstance(ref, str):
            by_model[model] = ref
            continue
        try:
            profiles[f"model:{model}"] = merged(inherited, ref)
        except ValidationError as exc:
            raise GuardConfigError(f"model '{model}': its guards are not valid: {exc}") from exc
        by_model[model] = f"model:{model}"
    named = [("default", config.default)] if config.default else []
    named += [(f"key {key}", name) for key, name in config.keys.items()]
    named += [(f"model '{model}'", name) for model, name in by_model.items()]
    for who, name in named:
        if name not in profiles:
            raise GuardConfigError(f"{who} names the guard profile '{name}', which is not declared")
    for name, profile in profiles.items():
        if profile.moderates() and config.moderation is None:
            raise GuardConfigError(f"the guard profile '{name}' moderates, but no moderation upstream is configured")
    return profiles, by_model
