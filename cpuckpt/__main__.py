"""``python -m cpuckpt``: the ``cpuckpt`` console script, with its exit status."""

from cpuckpt.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())  # main() returns the status (it catches click's SystemExit); dropping it exited 0
