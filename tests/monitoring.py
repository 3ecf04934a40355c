"""Moved to tests/tooling/monitoring.py. This name stays only for tests/integration/test_observability.py,
which imports it and is outside the tooling re-layout; drop it once that import says tests.tooling.monitoring."""

from tests.tooling.monitoring import all_exprs, exposed_names, is_exposed, metric_names

__all__ = ["all_exprs", "exposed_names", "is_exposed", "metric_names"]
