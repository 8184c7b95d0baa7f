"""Build hook for the cffi module (everything else is in pyproject.toml)."""

from setuptools import setup

setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"])
