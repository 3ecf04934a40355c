"""Everything that knows Starlette: the app (`application`), the one route table, request helpers,
the handlers (parse, call the pipeline, encode: `answers`), errors as HTTP answers (`errors`),
Server-Sent Events and the OpenAPI document."""
