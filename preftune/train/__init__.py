"""The training loop and its parts, and the `preftune.train(...)` entry point.

`preftune.train` is both this package and the public function: the package object is callable and
forwards to `preftune.api.train`, so `preftune.train(config, ...)` works whether or not a module of
the package (e.g. `preftune.train.loop`) has been imported, which rebinds the attribute to the package.
"""
import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, config, **kwargs):
        from preftune.api import train

        return train(config, **kwargs)

    @property
    def __signature__(self):
        import inspect

        from preftune.api import train

        return inspect.signature(train)


sys.modules[__name__].__class__ = _CallablePackage
