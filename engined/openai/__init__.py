"""`engined serve`'s OpenAI-compatible HTTP API, as vLLM 0.33 serves it (issue 22).

Nothing in `engined.core` or `engined.server` imports this package: the API servers are
ordinary control clients of the daemon, and the daemon runs without them.
"""
