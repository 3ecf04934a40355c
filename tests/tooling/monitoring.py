"""Reading the dashboard and alert rules in k8s/monitoring/: their PromQL and the metrics it reads."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import promql_parser
import yaml

MONITORING = Path(__file__).parents[2] / "k8s" / "monitoring"
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def alert_rules() -> list[dict]:
    document = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    return [rule for group in document["spec"]["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def all_exprs() -> list[str]:
    return [rule["expr"] for rule in alert_rules()] + dashboard_exprs()


def parse(expr: str):
    """Parse PromQL; Grafana's $__rate_interval becomes a plain range first."""
    return promql_parser.parse(expr.replace("$__rate_interval", "5m"))


def _walk(node) -> Iterator:
    """Every VectorSelector of a parsed expression."""
    if type(node).__name__ == "VectorSelector":
        yield node
    for attribute in ("lhs", "rhs", "expr", "vector_selector", "param"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, (int, float, str)):
            yield from _walk(child)
    for arg in getattr(node, "args", None) or ():
        yield from _walk(arg)


def metric_names(expr: str) -> set[str]:
    return {selector.name for selector in _walk(parse(expr)) if selector.name}


def selections(expr: str, metric: str) -> list[Callable[[str, str], bool]]:
    """For each read of `metric` in `expr`: whether its label matchers keep a series with label=value."""
    def holds(matcher, value: str) -> bool:
        op = promql_parser.MatchOp
        if matcher.op in (op.Equal, op.NotEqual):
            return (value == matcher.value) == (matcher.op == op.Equal)
        return (re.fullmatch(matcher.value, value) is not None) == (matcher.op == op.Re)

    def keeps(matchers: list, label: str, value: str) -> bool:
        return all(holds(m, value) for m in matchers if m.name == label)

    return [
        functools.partial(keeps, list(selector.matchers.matchers))
        for selector in _walk(parse(expr))
        if selector.name == metric
    ]


def exposed_names(exposition: str) -> set[str]:
    """Every metric name of an exposition, with and without its sample suffixes."""
    names = set(re.findall(r"^# TYPE (\S+) ", exposition, re.MULTILINE))
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", exposition, re.MULTILINE))
    return names


def is_exposed(metric: str, names: set[str]) -> bool:
    if metric in names or any(metric + s in names for s in SUFFIXES):
        return True
    return any(metric.endswith(s) and metric[: -len(s)] in names for s in SUFFIXES)
