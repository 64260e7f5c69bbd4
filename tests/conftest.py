"""Skip `gpu`-marked tests when no CUDA device is visible, so the suite runs cleanly on CPU machines; on a GPU,
report the tests a sticky CUDA error left unrunnable as such (cuda_poison.py)."""

import pytest
import torch

pytest_plugins = ["cuda_poison"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
