"""Command line: `python -m gateway serve [flags]`, one flag per setting (`options`), deep-merged over the
environment (`--max-model-len 512` keeps `GATEWAY_ENGINE__ENFORCE_EAGER`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine import check_engine_settings
from gateway.app import create_app
from gateway.backends.modelfile import ConfigError
from gateway.server.options import ENGINE_ARG_FLAG, Option, groups, options, summary
from gateway.server.supervisor import STARTUP_FAILED
from gateway.server.workers import gateway_server, serve_workers
from gateway.settings import Settings
from gateway.telemetry.logs import configure


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({exc.msg})") from exc


def _add(group: argparse._ArgumentGroup, option: Option) -> None:
    assert option.flag is not None
    text = f"{option.description} [{option.env}; default: {option.shown_default}]".replace("%", "%%")  # argparse's %
    kwargs: dict[str, Any] = {"dest": option.dest, "default": None, "help": text}
    if option.flag == ENGINE_ARG_FLAG:
        kwargs.update(type=_engine_arg, action="append", metavar="KEY=VALUE", help=(
            "any other vLLM engine argument by name, the value read as JSON when it parses (repeatable; "
            f"merged over {option.env})"))
    elif option.is_bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif option.choices is not None:
        kwargs.update(choices=option.choices, type=type(option.choices[0]))
    elif option.is_json:
        kwargs.update(type=_json, metavar="JSON")
    elif option.annotation in (int, float):
        kwargs.update(type=option.annotation, metavar=option.annotation.__name__.upper())
    else:
        kwargs["metavar"] = "PATH" if option.annotation is Path else "TEXT"
    group.add_argument(option.flag, **kwargs)


def parser() -> argparse.ArgumentParser:
    # no abbreviated flags: with a flag per setting, a unique prefix turns ambiguous when a setting is added
    root = argparse.ArgumentParser(prog="llm-gateway", description="OpenAI-compatible LLM gateway", allow_abbrev=False)
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="start the gateway",
        usage="llm-gateway serve [--FLAG VALUE ...]",
        description="Start the gateway. Every flag has an environment variable (in brackets); a flag given wins. "
        "Secrets (API keys, the key-id secret, the TLS key's password) are set in the environment only.",
    )
    sections = {prefix: serve.add_argument_group(".".join(prefix) or "gateway", summary(model) or None)
                for prefix, model in groups()}
    for option in options():
        if option.flag is not None:
            _add(sections[option.group], option)
    return root


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, nested as Settings takes them: {"engine": {"max_model_len": 512}, ...}."""
    given: dict[str, Any] = {}
    for option in options():
        value = getattr(args, option.dest, None)
        if option.flag is None or value is None:
            continue
        if option.flag == ENGINE_ARG_FLAG:
            value = dict(value)  # merged over the environment's engine_args (Settings deep-merges its sources)
        node = given
        for key in option.group:
            node = node.setdefault(key, {})
        node[option.path[-1]] = value
    return given


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(**overrides(args))  # the strongest source: flags given win over the environment


def serve(settings: Settings) -> int:
    if settings.workers > 1:
        return serve_workers(settings)
    configure(settings.log_level, settings.log_format)
    server = gateway_server(settings, lambda lifecycle, tenants: create_app(
        settings, lifecycle=lifecycle, engine_check=check_engine_settings, tenants=tenants))
    server.run()
    return 0 if server.started else STARTUP_FAILED


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # `serve`, the one command
    try:
        return serve(settings_from(args))
    except (ConfigError, ValidationError, ValueError) as exc:  # KeysFileError and TLSConfigError are ValueErrors
        print(f"llm-gateway: configuration error: {exc}", file=sys.stderr)
        return 2
