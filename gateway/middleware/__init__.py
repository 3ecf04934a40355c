"""Pure ASGI middleware, stacked by `stack`: each layer takes its paths from the route table."""
