"""One module per group of ``trainguard`` subcommands; :mod:`trainguard.cli` registers them."""
