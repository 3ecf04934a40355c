"""The request's journey in plain Python, without a web framework: who is asking (`context`),
which model answers (aliases, versions, splits, fallbacks) and what the key may reach
(`dispatch`), then per model: prepare and guard, quota, cache, admission, the embedded engine or
the remote upstream (`attempt`), answered as a whole or a stream of events (`answer`). The api/
layer parses a request, calls `dispatch` and encodes what it returns; a unit test can drive the
whole journey without HTTP."""
