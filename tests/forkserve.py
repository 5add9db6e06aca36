"""A Python child process without the cost of starting one (``conftest.forked``).

``forkserve.py``, started once per test module, imports torch, NumPy and trainguard once; then for
each JSON line ``[script, argv, env, log]`` read from stdin it forks a child that runs ``script`` (a
file's path, or the source of a ``python -c``) as ``__main__`` with ``sys.argv[1:] = argv`` and
``env`` added to its environment (a name given None: taken out), its stdout and stderr in the file ``log``; and writes the child's
exit status as one JSON line (``os.waitstatus_to_exitcode``: 17 for a crash point's ``os._exit(17)``,
-9 for a SIGKILL, 1 for an uncaught exception, ``sys.exit``'s code). Each child is a process of its
own that ends as the script ends it; the server waits for it before it reads the next line. A child
still running after 100 s is ended by SIGALRM (status -14), so a hung one cannot hang the test.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
import traceback

import numpy  # noqa: F401
import torch  # noqa: F401

import trainguard  # noqa: F401


def _child(script: str, argv: list[str], env: dict[str, str | None], log: str) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for k, v in env.items():  # None: taken out of the environment
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    signal.alarm(100)
    is_file = "\n" not in script and script.endswith(".py") and os.path.isfile(script)
    sys.argv = [script if is_file else "-c", *argv]
    try:
        if is_file:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        else:
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter runs at a normal exit, in its order:
    atexit._run_exitfuncs()  # non-daemon threads joined (trainguard's exit drain hooks it), then atexit
    return code


def main() -> None:
    for line in sys.stdin:
        script, argv, env, log = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(script, argv, env, log)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)


if __name__ == "__main__":
    main()
