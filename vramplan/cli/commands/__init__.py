"""One module per command (or group). Each imports vramplan.cli.options, never the app,
and adds itself with register(app)."""
