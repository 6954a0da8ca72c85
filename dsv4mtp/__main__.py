"""``python -m dsv4mtp``: the ``dsv4-mtp`` command, for when the console script is not on PATH."""

from dsv4mtp.tools.cli import main

if __name__ == "__main__":
    main(prog_name="dsv4-mtp")
