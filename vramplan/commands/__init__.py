"""CLI commands beyond cli.py's own, each module a thin shell with a `register(app)`."""
