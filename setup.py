"""Only the optional C extension; everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("shardtensor.redistribute._astar", ["src/shardtensor/redistribute/_astar.c"],
                             optional=True, extra_compile_args=["-O2"])])
