"""Guardrails on prompts and outputs, configured as named profiles (`config`), picked per request by
API key, model or default (`guarding`): input checks (`inbound`), the output guard (`stream`, and
`relay` for a remote model's answer), all reading text as `normalize` makes it."""
