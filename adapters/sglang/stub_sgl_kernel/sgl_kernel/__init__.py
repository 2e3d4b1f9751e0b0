"""A stand-in for `sgl_kernel` (SGLang's compiled kernels), for SGLang on CPUs without AMX.

There is no CPU build of sgl_kernel on PyPI (SGLang's CPU kernels are built from source and
target AMX), yet SGLang imports it at module level in many places. On this project's CPU path
(a Llama model, `--device cpu`, the `torch_native` attention backend SGLang falls back to
without AMX) none of its functions is called. This package lets those imports succeed: every
name, in this module or any submodule (`sgl_kernel.kvcacheio`, `sgl_kernel.flash_attn`, ...),
is a function that raises NotImplementedError when called, so a code path that does need a
real kernel fails loudly instead of computing something wrong.

`sgl_kernel.scalar_type` is absent on purpose: SGLang catches that ImportError and uses its
own placeholder scalar types. Put the directory *containing* this package on PYTHONPATH
(adapters/sglang/launcher.py does).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+relocator.stub"
IS_STUB = True

# Submodules that must stay missing: SGLang falls back to its own code on ImportError.
_MISSING = {"scalar_type"}


def _stub(qualname: str):
    def missing(*_args, **_kwargs):
        raise NotImplementedError(
            f"{qualname} is a stand-in (relocator's stub sgl_kernel): this SGLang code path needs "
            "the real compiled sgl_kernel, which has no CPU build here"
        )

    missing.__name__ = qualname.rsplit(".", 1)[-1]
    missing.__qualname__ = qualname
    return missing


def _module_getattr(modname: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{modname}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes any `sgl_kernel.<sub>[.<sub>...]` importable as a stub package."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] != __name__ or len(parts) < 2:
            return None
        if parts[1] in _MISSING:
            return None  # -> ModuleNotFoundError
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())
