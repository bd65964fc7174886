"""Python's cyclic garbage collector paused around tfpar's graph work."""
import contextlib
import gc

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused():
    """The collector off inside the block: planning and rewriting make
    hundreds of thousands of objects that live on (ops, tensors, maps), and
    the collector would scan them again and again (it doubled the time to
    read a 96-layer GPT for the planner, and cost about a second of a
    pipeline's start-up)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
