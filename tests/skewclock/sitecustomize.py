"""Test aid: TG_TEST_CLOCK_SKEW=S shifts the wall clock torch's c10d rendezvous reads by S seconds (one node's clock
off), nothing else."""
import os
import sys

_SKEW = os.environ.get("TG_TEST_CLOCK_SKEW")
_MOD = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

if _SKEW:
    import importlib.abc
    import importlib.util
    from datetime import datetime as _dt
    from datetime import timedelta as _td

    class _Skewed(_dt):
        @classmethod
        def now(cls, tz=None):
            return _dt.now(tz) + _td(seconds=float(_SKEW))

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _MOD:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            orig = spec.loader.exec_module

            def exec_module(module):
                orig(module)
                module.datetime = _Skewed

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
