"""Runtime: load cubins with the driver API and launch them on the current PyTorch stream."""

