"""Command-line interface: ``gefen demo`` and friends."""
