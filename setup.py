"""The hook's C hot paths (hooks/_fastpath.c). Optional: where it does not compile, the tracker runs its
Python hot paths (hooks/tracker.py PyCore) and everything else is unchanged. Metadata: pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("rankwatch.hooks._fastpath", ["hooks/_fastpath.c"], optional=True, extra_compile_args=["-O2"]),
    ]
)
