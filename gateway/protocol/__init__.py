"""The APIs' wire formats as pydantic models, one module per API."""
