"""STAND-IN until mcp41g's `mcp core:` commit is merged (then deleted): the interface only."""
