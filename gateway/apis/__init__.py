"""One package per API (its wire models, routes and translation to the pipeline), the route table and the OpenAPI document."""
