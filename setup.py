"""The compiled part of the block service (everything else is in pyproject.toml).

block_service/_stepwire.c runs Steps from the request's bytes to the answer's. It is optional:
where it cannot be built (no C compiler) the block service runs Steps on its Python path, with
the same answers and several times the CPU per Step (a warning says so at start).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "block_service._stepwire", ["block_service/_stepwire.c"],
    extra_compile_args=["-O2", "-Wall"], optional=True)])
