"""Megatron adapter tests: the channel files of ranks a test killed or failed are removed after each test.

A trainer killed mid-save (or a rank that raised before finalize) cannot remove its ``cpuckpt-megatron-*``
channel files; the product removes them at the next trainer's first channel (``cpuckpt.runfiles``, by owner
pid and boot). Each test's ranks have ended when it returns, so this does here what that next run does.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _stale_channel_files_removed():
    yield
    from cpuckpt.runfiles import clean_stale

    clean_stale()
