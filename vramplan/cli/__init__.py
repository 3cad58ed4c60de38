"""The `vramplan` command, a thin shell: parse flags -> Job -> engine or planner -> view.

    app.py       the typer app, the default command, --version, main() and exit codes
    options.py   what commands share: job flags generated from the Job, --job, --set, outputs
    commands/    one module per command; each imports options.py, never app.py
"""
