"""Loaded by every Python process a measured test run starts (RANKWATCH_TEST_CPU puts this folder on
PYTHONPATH): when torch is really imported (its package executed, not merely looked up with find_spec),
one line, ``pid argv``, is appended to $RANKWATCH_TEST_TORCH_LOG, so a test's measurement says how many
processes paid torch's import (~1.6 s of CPU each here)."""

import os
import sys
from importlib.machinery import PathFinder


def _note() -> None:
    try:
        with open(os.environ["RANKWATCH_TEST_TORCH_LOG"], "a") as f:
            f.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}".replace("\n", " ") + "\n")
    except (OSError, KeyError):
        pass


class _TorchImportProbe:
    """A meta-path finder that finds torch as the path finder does, with the package's execution noted."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            _note()
            run(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("RANKWATCH_TEST_TORCH_LOG"):
    sys.meta_path.insert(0, _TorchImportProbe())
