"""Shared by every Python test. Tests marked `cuda` run a CUDA path and skip where there is no GPU;
with VRAMD_REQUIRE_CUDA=1, as scripts/gpu-check sets on a machine that has one, such a skip is
a failure instead, so that no CUDA test goes unrun there."""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("cuda") and os.environ.get("VRAMD_REQUIRE_CUDA") == "1":
        report.outcome = "failed"
        report.longrepr = f"a CUDA test skipped where every CUDA test must run (VRAMD_REQUIRE_CUDA=1): {report.longrepr}"
