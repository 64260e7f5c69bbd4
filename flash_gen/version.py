"""The package version, in a module of its own so torch-free code (the cubin cache key) can read it without
importing flash_gen/__init__.py. Keep it equal to `version` in pyproject.toml."""

FLASH_GEN_VERSION = "0.1.0"
