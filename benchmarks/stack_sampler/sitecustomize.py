"""A sampling profile of a training process's main thread, for bench_goodput's ``--sample`` (an instrument).

Put on PYTHONPATH (bench_goodput does it for the runs it samples), this starts a daemon thread in every
Python process whose command line names ``CPUCKPT_SAMPLE_MATCH`` (default ``pretrain_gpt``); every
``CPUCKPT_SAMPLE_MS`` (default 2) ms it reads the main thread's stack (``sys._current_frames``) and counts, for
the samples taken inside the training loop (a frame ``training.py:train``), every function on the stack once
(inclusive) and the innermost four frames (where the thread is). The counts go to
``$CPUCKPT_SAMPLE_OUT/sample_<pid>.json`` every 5 s and at exit. A sample is about 20 us of the GIL.

Another ``sitecustomize`` further down ``sys.path`` (an image's own) still runs after this one.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import json
import os
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_original() -> None:
    """The next ``sitecustomize.py`` on ``sys.path`` (``benchmarks/sitechain.py``)."""
    spec = importlib.util.spec_from_file_location("_cpuckpt_sitechain", os.path.join(os.path.dirname(_HERE),
                                                                                       "sitechain.py"))
    if spec is not None and spec.loader is not None:
        chain = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(chain)
        chain.run_next(_HERE)


def _key(frame) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class _Sampler:
    def __init__(self, out: str, interval_s: float, loop: str) -> None:
        self.out, self.interval_s, self.loop = out, interval_s, loop
        self.main = threading.main_thread().ident
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.samples = self.in_loop = 0
        self.t0 = time.time()
        self.lock = threading.Lock()

    def run(self) -> None:
        last_dump = time.monotonic()
        while True:
            time.sleep(self.interval_s)
            frame = sys._current_frames().get(self.main)
            keys = []
            while frame is not None and len(keys) < 60:
                keys.append(_key(frame))
                frame = frame.f_back
            with self.lock:
                self.samples += 1
                if self.loop in keys:
                    self.in_loop += 1
                    self.inclusive.update(set(keys))
                    self.leaf[" < ".join(keys[:4])] += 1
            if time.monotonic() - last_dump > 5:
                self.dump()
                last_dump = time.monotonic()

    def dump(self) -> None:
        with self.lock:
            data = {"pid": os.getpid(), "argv": sys.argv[:3], "interval_ms": self.interval_s * 1e3,
                    "samples": self.samples, "in_loop": self.in_loop, "seconds": round(time.time() - self.t0, 1),
                    "inclusive": dict(self.inclusive.most_common(300)), "leaf": dict(self.leaf.most_common(300))}
        path = os.path.join(self.out, f"sample_{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)


def _start() -> None:
    out = os.environ.get("CPUCKPT_SAMPLE_OUT")
    if not out or os.environ.get("CPUCKPT_SAMPLE_MATCH", "pretrain_gpt") not in " ".join(sys.argv):
        return
    os.makedirs(out, exist_ok=True)
    sampler = _Sampler(out, float(os.environ.get("CPUCKPT_SAMPLE_MS", "2")) / 1e3,
                       os.environ.get("CPUCKPT_SAMPLE_LOOP", "training.py:train"))
    threading.Thread(target=sampler.run, name="stack-sampler", daemon=True).start()
    atexit.register(sampler.dump)


_start()
_chain_original()
