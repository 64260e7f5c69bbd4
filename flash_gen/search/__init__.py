"""Autotuning (Optuna) over the spaces declared in flash_gen.spec."""

