"""The HTTP server: OpenAI routes, the shadow's routes, /metrics, profiles. `qse serve` starts it (cli.py)."""
