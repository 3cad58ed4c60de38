"""The `vramplan` console command and `python -m vramplan`: a Ctrl-C while the CLI's
libraries load (about half a second) prints its one line and exits 130, as one later does,
instead of an import traceback."""

from __future__ import annotations

import os
import signal
import sys

EXIT_INTERRUPTED = 130  # as cli/options.py says; not imported from there, which is heavy


def _interrupted_while_loading(signum, frame) -> None:
    sys.stderr.write("interrupted (Ctrl-C)\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)  # half-imported modules are not worth unwinding


def main(argv: list[str] | None = None) -> None:
    try:
        previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
    except ValueError:  # not the main thread (an embedding program): its handlers stay
        previous = None
    try:
        from vramplan.cli.app import main as run
        if previous is not None:
            signal.signal(signal.SIGINT, previous)  # from here main() turns Ctrl-C into its line
        run(argv)
    except KeyboardInterrupt:  # one that lands between the two handlers, or before run's own
        _interrupted_while_loading(signal.SIGINT, None)
    except SystemExit as done:
        if done.code == EXIT_INTERRUPTED and previous is not None:  # (not an embedding)
            # leave at once: a Ctrl-C caught late in the libraries' loading could otherwise
            # end the process by the signal itself during shutdown (exit -2, not 130)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(EXIT_INTERRUPTED)
        raise
