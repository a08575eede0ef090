"""``python -m cpuckpt``: the ``cpuckpt`` console script."""

from cpuckpt.tools.cli import main

main()
