"""``python -m trainguard ...``: the same command as ``trainguard ...`` (and ``python -m trainguard.cli``)."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="trainguard")
