"""Keep one busy OpenMP thread team per process: release a thread's team when it stops computing.

torch's CPU wheels run intra-op parallelism on libgomp, which gives every thread that has run a
parallel region its own team of worker threads and keeps it after the region ends. Once the
teams of all threads hold more threads than the machine has CPUs, libgomp stops spinning between
parallel regions in *every* team and sleeps on a futex instead (its "throttled" spin count), so
each of the thousands of small regions of a decode step pays a wake-up. The embedded engine
computes in its own thread while the trainer or the caller computes in the main thread, which is
exactly that case: on the 2-core machine one parallel op in the main thread made the engine's
decode 25% slower for the rest of the process (SmolLM2-135M, 64 rows, 12.9 s -> 16.0 s for 65
steps), and the engine's idle team slows the trainer's own regions the same way.

:func:`release_thread_team` frees the calling thread's team (libgomp's
``omp_pause_resource_all(omp_pause_hard)`` frees the calling thread's pool); its next parallel
region starts a new one. The engine calls it in its thread when it goes idle and in the
requesting thread when a request arrives. With another OpenMP runtime, or none, it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

__all__ = ["release_thread_team"]

_OMP_PAUSE_HARD = 2


@functools.cache
def _pause_function():
    """libgomp's ``omp_pause_resource_all`` as torch loaded it, or ``None``."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        gomp = ctypes.CDLL(library if os.path.exists(library) else "libgomp.so.1")
        function = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function


def release_thread_team() -> bool:
    """Free the calling thread's idle OpenMP worker team (see the module docstring).

    Call it only between torch operations of the calling thread (never from inside one).

    Returns:
        ``True`` when libgomp released it (or the thread had none), ``False`` where the runtime
        is not libgomp.
    """
    function = _pause_function()
    return function is not None and function(_OMP_PAUSE_HARD) == 0
