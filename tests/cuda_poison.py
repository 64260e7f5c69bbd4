"""A pytest plugin (loaded by conftest.py): after a test fails with a sticky CUDA error (an illegal instruction,
address or launch failure), every later launch in the same process fails too, so the worker's remaining GPU tests
are reported as setup errors ("not run: ..."), naming the test that left the context unusable, instead of as
failures of their own (a faulting kernel once turned five broken cases into 89 failures, 2026-12-05)."""

from __future__ import annotations

import pytest

# Lower-cased fragments of the messages torch and flash_gen.errors.CudaError give for errors that poison a context.
STICKY = ("illegal instruction", "illegal_instruction", "illegal memory access", "illegal_address",
          "misaligned address", "misaligned_address", "unspecified launch failure", "launch_failed")

_poisoned_by: str | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    global _poisoned_by
    report = (yield).get_result()
    if _poisoned_by is None and report.failed and call.excinfo is not None:
        if any(s in str(call.excinfo.value).lower() for s in STICKY):
            _poisoned_by = item.nodeid


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _poisoned_by is not None and "gpu" in item.keywords:
        pytest.fail(f"not run: {_poisoned_by} left this process's CUDA context unusable (a sticky error)",
                    pytrace=False)
