"""The Megatron-LM hook's command-line handling, and the strategy classes it hands Megatron-LM.

Megatron-LM itself (``megatron.training``) is not on PyPI: CI checks the argument rewriting and that
the classes it installs are torch_dist strategies Megatron-LM can construct with its own keyword
arguments; the device run drives Megatron-LM's real ``pretrain_gpt.py`` through the launcher.
"""

from __future__ import annotations

import importlib.util

import pytest
from cpuckpt.integrations.megatron.hook import Selection, install, rewrite_argv

from cpuckpt.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--ckpt-format", "cpuckpt", "--save", "d"],
         Selection(True, None, ["--ckpt-format", "torch_dist", "--save", "d"])),
        (["--ckpt-format=cpuckpt"], Selection(True, None, ["--ckpt-format", "torch_dist"])),
        (["--dist-ckpt-format", "cpuckpt"], Selection(True, None, ["--ckpt-format", "torch_dist"])),
        (["--ckpt-format", "cpuckpt", "--cpuckpt-config", "c.yaml", "--async-save"],
         Selection(True, "c.yaml", ["--ckpt-format", "torch_dist", "--async-save"])),
        (["--cpuckpt-config=c.yaml", "--ckpt-format", "cpuckpt"],
         Selection(True, "c.yaml", ["--ckpt-format", "torch_dist"])),
        (["--ckpt-format", "torch_dist", "--lr", "1e-4"],
         Selection(False, None, ["--ckpt-format", "torch_dist", "--lr", "1e-4"])),
        (["--ckpt-format", "torch"], Selection(False, None, ["--ckpt-format", "torch"])),
        (["--ckpt-format"], Selection(False, None, ["--ckpt-format"])),  # Megatron's parser reports it
        ([], Selection(False, None, [])),
    ],
)
def test_rewrite_argv(argv, want):
    assert rewrite_argv(argv) == want


def test_config_without_cpuckpt_format_is_an_error():
    with pytest.raises(ConfigError, match="--ckpt-format is not cpuckpt"):
        rewrite_argv(["--ckpt-format", "torch_dist", "--cpuckpt-config", "c.yaml"])
    with pytest.raises(ConfigError, match="needs a path"):
        rewrite_argv(["--ckpt-format", "cpuckpt", "--cpuckpt-config"])


def test_install_leaves_other_formats_alone():
    argv = ["pretrain_gpt.py", "--ckpt-format", "torch_dist"]
    assert install(argv=argv) is False
    assert argv == ["pretrain_gpt.py", "--ckpt-format", "torch_dist"]


def test_install_checks_config_before_training(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("io:\n  threads: many\n")
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt", "--cpuckpt-config", str(bad)]
    with pytest.raises(ConfigError, match="threads"):
        install(argv=argv)
    assert argv[2] == "cpuckpt", "argv rewritten although the hook failed"


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None, reason="Megatron-LM is importable here")
def test_install_without_megatron_lm_says_what_is_missing():
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]
    with pytest.raises(ImportError, match="Megatron-LM"):
        install(argv=argv)


def test_classes_megatron_lm_constructs_are_torch_dist_strategies(tmp_path):
    pytest.importorskip("megatron.core")
    from cpuckpt.integrations.megatron.hook import _training_classes
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    from cpuckpt.config import Config

    cfg = Config.from_dict({"io": {"threads": 3}})
    save_cls, load_cls = _training_classes(cfg)
    save = save_cls(cpu_shm_mode=False)  # exactly how megatron.training.checkpointing builds them
    load = load_cls(cache_metadata=True, stream_ckpt_dequant=False)
    assert isinstance(save, TorchDistSaveShardedStrategy) and isinstance(load, TorchDistLoadShardedStrategy)
    assert save.backend == "torch_dist" and save.config.io.threads == 3
    assert load.cache_metadata is True and load.config.io.threads == 3


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs Megatron-LM (device run)")
def test_install_patches_megatron_training(tmp_path):
    import megatron.training.checkpointing as mlm
    from cpuckpt.integrations.megatron.strategy import CpuckptLoadStrategy, CpuckptSaveStrategy

    originals = (mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy)
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]
    try:
        assert install(argv=argv) is True
        assert issubclass(mlm.TorchDistSaveShardedStrategy, CpuckptSaveStrategy)
        assert issubclass(mlm.TorchDistLoadShardedStrategy, CpuckptLoadStrategy)
    finally:
        mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy = originals
