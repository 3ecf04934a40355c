"""Pure ASGI middleware, in the order the app stacks them (`stack`, outermost first): `access_log`,
`lifecycle`, `auth`, `rate_limit`, `body`. Each takes its paths from the route table, passed in by
the app; of the API layer they use only `api.errors` (errors rendered in the route's shape), and
they fill the request's context (`pipeline.context`)."""
