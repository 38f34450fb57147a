"""``python -m aisp.cli``."""

from aisp.cli import main

main()
