"""The APIs' wire formats as pydantic models, one module per API: `openai` (chat, completions,
models, errors, and the native routes' shapes beside them), `anthropic` (Messages) and
`embeddings` (OpenAI's embeddings)."""
