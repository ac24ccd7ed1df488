"""Loaded by every Python process a measured test run starts (RANKWATCH_TEST_CPU puts this folder on
PYTHONPATH): the first ``import torch`` appends one line, ``pid argv``, to $RANKWATCH_TEST_TORCH_LOG, so a
test's measurement says how many processes paid torch's import (~1.6 s of CPU each here)."""

import os
import sys


class _TorchImportProbe:
    """A meta-path finder that finds nothing: it only notes the first time torch is looked up."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            log = os.environ.get("RANKWATCH_TEST_TORCH_LOG")
            if log:
                try:
                    with open(log, "a") as f:
                        f.write(f"{os.getpid()} {' '.join(sys.argv)[:300]}\n".replace("\n", " ").rstrip() + "\n")
                except OSError:
                    pass
        return None


if os.environ.get("RANKWATCH_TEST_TORCH_LOG"):
    sys.meta_path.insert(0, _TorchImportProbe())
