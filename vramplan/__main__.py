"""`python -m vramplan` (also what torchrun runs: torchrun ... -m vramplan measure ...)."""

from vramplan.cli.app import main

main()
