"""The demo: a tiny char-level GPT trained on the Python standard library's own source files
(present on every machine, no download), killed and resumed under ``trainguard run``.

:mod:`.model` (the model and the corpus), :mod:`.train` (the worker script that
``trainguard run`` launches), :mod:`.driver` (``trainguard demo``: both runs, the table).
"""
