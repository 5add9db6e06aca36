"""Benchmark harness for trainguard (issue 6): save/load/async-stall against the baselines.

Entry point: ``python -m bench.run`` (see ``bench/run.py --help``). One worker process per state
(two for the 2-rank case) builds the state once and measures every method on the same data,
round-robin, so ratios can be taken pair by pair within a round. trainguard itself is reached
only through :mod:`bench.methods_trainguard`.

Module map: ``run`` (CLI, spawns workers) -> ``worker`` (one process per rank) -> ``methods*``
(what is measured) with ``measure`` (timers, peak RSS, fsync, cache dropping), ``states``
(what is saved), ``loop`` (training loop for async stalls); ``report`` / ``plot`` / ``sysinfo``
turn the workers' JSON into bench/results/latest.{json,md,png}.
"""
