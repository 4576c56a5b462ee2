"""``python -m gefen`` is the same as the ``gefen`` console script."""

from gefen.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
