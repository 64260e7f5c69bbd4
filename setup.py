"""The package's one C extension, the per-call kernel launcher (flash_gen/runtime/_launch.c); everything else is
declared in pyproject.toml. optional=True: without a C compiler the install still succeeds and the runtime
launches through ctypes instead (flash_gen.runtime.driver)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("flash_gen.runtime._launch", ["flash_gen/runtime/_launch.c"], libraries=["dl"],
                             optional=True)])
