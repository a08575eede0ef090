"""Run an unmodified Megatron-LM training script with ``--ckpt-format cpuckpt`` available.

    python -m cpuckpt.integrations.megatron.launch pretrain_gpt.py --ckpt-format cpuckpt \\
        --cpuckpt-config configs/megatron.yaml --async-save --use-persistent-ckpt-worker ...
    torchrun --nproc-per-node 8 -m cpuckpt.integrations.megatron.launch pretrain_gpt.py ...

It installs the hook (:mod:`.hook`), then runs the script as ``__main__`` with the script's folder
first on ``sys.path``, as ``python pretrain_gpt.py`` would.
"""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path

from .hook import install


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m cpuckpt.integrations.megatron.launch SCRIPT.py [script arguments]")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    script = args[0]
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, str(Path(script).resolve().parent))  # Megatron-LM's checkout: the hook imports from it
    install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
