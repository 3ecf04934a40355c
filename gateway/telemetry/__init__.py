"""What the gateway tells its operators: Prometheus metrics, declared once (`metrics`), structured
logs (`logs`) and the per-request record the access line and metrics report (`record`)."""
