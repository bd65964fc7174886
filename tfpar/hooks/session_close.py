"""Sessions of a cluster that lost a worker close without waiting for it.

Closing a session asks every worker to drop its graphs, and waits for the
answers: for a worker that is gone or stopped, 30 s (``Session.__exit__``'s
limit after an error) or forever. Once a run raised ``ClusterError``, the
session's ``close`` runs in the background and returns at once.
"""
import threading
import weakref

from tfpar.compat.tf import tf_session

__all__ = ["add_session_close_patches", "lost_worker"]

_lost: "weakref.WeakSet" = weakref.WeakSet()


def lost_worker(session) -> None:
    """``session``'s cluster lost a worker: its next close does not wait."""
    _lost.add(session)


def add_session_close_patches(patches) -> None:
    patches.add(tf_session.BaseSession, "close", _wrap_close)


def _wrap_close(original):
    def close(self):
        if self not in _lost:
            return original(self)
        _lost.discard(self)
        threading.Thread(target=original, args=(self,), name="tfpar-session-close",
                         daemon=True).start()
        return None
    return close
