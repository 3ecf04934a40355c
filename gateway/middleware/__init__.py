"""Pure ASGI middleware, in the order the app stacks them (outermost first): `access_log`,
`lifecycle`, `auth`, `rate_limit`. Each takes its paths from the route table, passed in by the app;
none imports the API layer."""
