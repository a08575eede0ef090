"""The module names of cpuckpt 0.1.0 keep working for one release (with a DeprecationWarning).

OLD_ALL is each old module's ``__all__`` as 0.1.0 shipped it, less the test machinery that left the
product on purpose (``commit.test_hook``, ``fileio.FaultInjectingBackend``/``KillingBackend``: now
``cpuckpt.testing.faults``, active only when a test installs it).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import cpuckpt
import cpuckpt.api

OLD_ALL = {
    "catalog": ["Description", "ListedCheckpoint", "TensorInfo", "describe", "identify", "scan_root", "tensors_of"],
    "checkpointer": ["AsyncSaveHandle", "async_save", "wait_all"],
    "checkpoints": ["LATEST_NAME", "CheckpointInfo", "after_commit", "apply_retention", "clean_incomplete",
                    "find_latest", "install_sigterm_handler", "list_checkpoints", "loading", "read_latest",
                    "update_latest"],
    "cli": ["cli", "main"],
    "commit": ["METADATA_NAME", "clear_commit", "commit_checkpoint", "is_complete", "load_metadata", "read_manifest",
               "write_atomic"],
    "configdoc": ["config_markdown"],
    "engine": ["SaveJob", "choose_mode"],
    "export": ["ExportReport", "export_checkpoint"],
    "fileio": ["BufferedFileBackend", "DirectFileBackend", "FileBackend", "fsync_dir", "get_backend",
               "register_backend"],
    "layout": ["Chunk", "FileLayout", "LayoutItem", "Placement", "Segment", "plan_files"],
    "manifest": ["FORMAT_VERSION", "MANIFEST_NAME", "FileEntry", "Manifest", "manifest_from_json", "part_name"],
    "pipeline": ["Cancelled", "new_executor", "run_parallel", "shared_executor", "wait_future"],
    "plancache": ["CachedPlan", "reused_metadata", "structure_signature"],
    "reader": ["StorageReader"],
    "record": ["RecordTemplate", "SparseSink", "TensorRecordInfo", "parse_record", "record_template"],
    "snapshot": ["PoolSnapshot", "snapshot_state_dict"],
    "staging": ["DeviceCopier", "HostPool", "LeaseOrder", "Slot", "fill_chunk", "flat_bytes", "get_pool"],
    "telemetry": ["TelemetryRecord", "nvtx_range", "record_load", "record_save"],
    "verification": ["Damage", "VerifyReport", "verify_checkpoint"],
    "writer": ["StorageWriter", "resolve_config"],
}


@pytest.mark.parametrize("old", sorted(OLD_ALL))
def test_old_module_name_still_imports_and_warns(old):
    sys.modules.pop(f"cpuckpt.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"cpuckpt.{old} moved to"):
        module = importlib.import_module(f"cpuckpt.{old}")
    for name in OLD_ALL[old]:
        assert getattr(module, name) is not None, f"cpuckpt.{old}.{name}"
    with pytest.raises(AttributeError, match="moved to"):
        module.no_such_name


def test_old_api_helpers_resolve_with_a_warning():
    from cpuckpt.backend import collectives

    for name in ("checkpoint_group", "dcp_save", "new_gloo_group", "resolve_stateful"):
        with pytest.warns(DeprecationWarning, match="backend.collectives"):
            assert getattr(cpuckpt.api, name) is getattr(collectives, name)


def test_public_surface_is_unchanged():
    old_init = ["AsyncSaveHandle", "CheckpointCorrupt", "CheckpointTimeoutError", "Config", "ConfigError",
                "CpuckptError", "IntegrityError", "StagingError", "StorageIOError", "StorageReader", "StorageWriter",
                "__version__", "apply_retention", "async_save", "clean_incomplete", "find_latest",
                "install_sigterm_handler", "list_checkpoints", "load", "prepare_pool", "read_latest", "save",
                "update_latest", "wait_all"]
    assert set(old_init) <= set(cpuckpt.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the package itself imports no old name
        for name in cpuckpt.__all__:
            getattr(cpuckpt, name)


def test_python_dash_m_old_cli_runs_the_new_one():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "cpuckpt.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "inspect" in proc.stdout and "verify" in proc.stdout
