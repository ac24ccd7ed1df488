"""Loaded by every Python process the test suite starts (tests/conftest.py puts this folder on the PYTHONPATH
that children inherit): the ranks, their torchrun agents, rankwatch's own processes.

1. Less garbage-collector work, the same program. Once torch's package has run, its import-time objects
   (about a million) are moved out of the collector's reach (``gc.freeze()``): they live as long as the
   process anyway, but every full collection after it walked them all. Measured here: a process that builds
   an optimizer (which imports torch._dynamo, ~1 s more of imports) 3.2 -> 2.8 s of CPU. The program's own
   objects are collected as before.
2. A quick interpreter exit. At exit CPython collects the whole heap and tears every module down: with torch
   imported 0.4-0.8 s of CPU per process (``import torch`` 1.8 -> 1.4 s; with an optimizer 3.5 -> 2.7 s),
   over ~360 torch processes a run. ``gc.freeze()`` as the last exit handler (registered first: exit
   handlers run last-in first-out) keeps the heap out of the final collections; every exit handler (the
   hook's, torch's) still runs first.
3. ``RANKWATCH_TEST_TORCH_LOG`` (tests/cpu_measure.py): when torch is really imported (its package executed,
   not merely looked up with find_spec), one line, ``pid argv``, is appended to that file, so a test's
   measurement says how many processes paid torch's import; and every Python process that exits through
   its exit handlers appends ``cpu: pid seconds torch argv`` to ``$RANKWATCH_TEST_TORCH_LOG.cpu`` (its own
   CPU up to its last exit handler), which says where the suite's CPU goes by script.

Only the suite's children get this; the product never changes its host process's collector."""

import atexit
import gc
import os
import sys
from importlib.machinery import PathFinder


def _note_cpu() -> None:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open(os.environ["RANKWATCH_TEST_TORCH_LOG"] + ".cpu", "a") as f:
            argv = " ".join(sys.argv)[:300].replace("\n", " ")
            f.write(f"cpu: {os.getpid()} {r.ru_utime + r.ru_stime:.3f} {int('torch' in sys.modules)} {argv}\n")
    except (OSError, KeyError):
        pass


if os.environ.get("RANKWATCH_TEST_TORCH_LOG"):
    atexit.register(_note_cpu)  # registered before the freeze: it runs after it, last of all
atexit.register(gc.freeze)


def _note() -> None:
    try:
        with open(os.environ["RANKWATCH_TEST_TORCH_LOG"], "a") as f:
            f.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}".replace("\n", " ") + "\n")
    except (OSError, KeyError):
        pass


class _AfterTorchImport:
    """A meta-path finder that finds torch as the path finder does; once the package has run, its objects are
    frozen (and, measuring, the import is noted)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            if os.environ.get("RANKWATCH_TEST_TORCH_LOG"):
                _note()
            run(module)
            gc.freeze()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorchImport())
