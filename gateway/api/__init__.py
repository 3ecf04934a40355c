"""Everything that knows Starlette: the one route table, request helpers, the handlers, the
dispatcher, Server-Sent Events, disconnect watching and the OpenAPI document."""
