"""Gloo ranks for the CPU distributed tests (test_distributed, test_fp8_all_gather)."""
from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path

import torch.multiprocessing as mp


def spawn_ranks(worker, world: int, tmp: Path, args: tuple, preload: list[str]) -> None:
    """``world`` gloo ranks running ``worker(rank, init_file, *args)``, forked from a server that imported torch,
    lpoptim and ``preload`` (the calling test module, say) once, so that a rank starts at once; spawned, each would
    import them again (about 2.5 s of CPU a rank). The server starts at the first call of the process and reads the
    preload list then; a module that cannot be imported is skipped there, and later calls' modules are imported by
    the ranks that need them. A worker killed by a signal (seen once in a CI run, spawned: SIGABRT, "terminate
    called without an active exception", after the single-process checkpoint was written; not reproduced in 14
    reruns) is retried once with a fresh rendezvous file; an exception raised in a worker fails the tests as it
    is."""
    multiprocessing.set_forkserver_preload(["lpoptim", *preload])
    for attempt in range(2):
        try:
            mp.start_processes(worker, args=(str(tmp / f"init_{worker.__name__}_{attempt}"), *args), nprocs=world,
                               join=True, start_method="forkserver")
            return
        except mp.ProcessExitedException as e:
            if attempt or e.signal_name is None:
                raise
            warnings.warn(f"a gloo worker died ({e}); running the {world} ranks again")
