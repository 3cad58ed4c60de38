"""`python -m vramplan` (also what torchrun runs: torchrun ... -m vramplan measure ...)."""

from vramplan.cli.entry import main

main()
