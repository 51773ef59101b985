"""Shut down with nothing in flight: every issued collective finished, every ring worker joined.

Why: after ``optimizer.step()`` the engine leaves the all-gathers that install the
updated weights in flight (they overlap the next forward), and the gloo ring
reduce-scatter runs on a worker thread per group. A process that then calls
``destroy_process_group()`` and exits tore the groups down under live work: gloo's
threads still sent to a peer that was gone (a 60 s hang in ``destroy_process_group``),
and a Python thread still inside a gloo call when the interpreter finalized was ended
by ``pthread_exit``, unwinding through C++ frames: ``terminate called without an
active exception`` (exit -6) after all output.

``shutdown()`` waits for all of it; call it before ``destroy_process_group()``. It
also runs at interpreter exit (``atexit``), which is enough for a script that never
destroys its groups. It is idempotent and collective-free: it only waits for
collectives every rank has already issued.
"""

from __future__ import annotations

import atexit
import weakref

from .gloo_ring import shutdown_workers

_runtimes: "weakref.WeakSet" = weakref.WeakSet()


def track(runtime) -> None:
    """Remember a model's runtime (weakly) so ``shutdown()`` can wait for its work."""
    _runtimes.add(runtime)


def wait_in_flight() -> None:
    """Wait for every collective issued by every live wrapped model (install gathers, reductions)."""
    for runtime in list(_runtimes):
        runtime.wait_all()


def shutdown(timeout: float = 60.0) -> bool:
    """Finish all in-flight engine work and end the ring workers; True when everything ended in time."""
    wait_in_flight()
    return shutdown_workers(timeout)


def _at_exit() -> None:
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - a peer already gone: exiting anyway, say nothing more
        pass


atexit.register(_at_exit)  # after gloo_ring's own hook is registered, so it runs first
