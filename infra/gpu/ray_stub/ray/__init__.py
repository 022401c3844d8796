"""Stands in for Ray on a lent GPU machine only: `make gpu-check` puts infra/gpu/ray_stub on PYTHONPATH there.

verl imports ray at module level (verl.protocol, verl.utils.distributed, ...), but flywheel drives verl's
engines without Ray and never starts it; Ray's wheel (79 MB) is over the 64 MiB a device call carries. Names
resolve at import time (classes, decorators, submodules); starting Ray, or anything else that would need it,
raises RuntimeError.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_WHY = "Ray is not installed on this machine (infra/gpu/ray_stub stands in for verl's imports only)"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _Stub(metaclass=_Meta):
    """Any Ray name: usable as a base class, a type hint, an isinstance target and a decorator."""

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):  # @ray.remote
            return args[0]
        if not args:  # @ray.remote(num_cpus=1), or a Ray object made with options
            return lambda target: target
        raise RuntimeError(_WHY)


def init(*args, **kwargs):
    raise RuntimeError(_WHY)


def is_initialized() -> bool:
    return False


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import ray.x.y` gives a module whose every name is a _Stub."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
