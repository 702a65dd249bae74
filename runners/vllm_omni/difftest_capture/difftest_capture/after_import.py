"""Run a patch on a module right after it is first imported, in whichever process imports it.

For modules that live deep in vLLM-Omni's import tree (heavy or circular to import from a plugin's
`register()`): `when_imported(name, patch)` patches at once when the module is already loaded, else
when it is executed. A patch that fails is logged; the import goes on."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger("vllm.difftest_capture")


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, patch: Callable):
        self.name, self.patch, self._busy = name, patch, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True  # let the other finders find the real module
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self.patch(module)
        except Exception:
            logger.exception("difftest: could not patch %s", self.name)
        finally:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def when_imported(name: str, patch: Callable) -> None:
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))
