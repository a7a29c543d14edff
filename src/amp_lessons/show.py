"""Cells that show an error on purpose (00, 02, 04).

``with expect_error(ValueError): ...`` runs the block, prints the error it raises the way
a traceback's last line reads, and lets the notebook go on. A raising cell stops "Run all"
there, and the ``raises-exception`` cell tag that lets JupyterLab and nbval go on past it
is a convention that not every frontend follows (Colab does not document it), so a lesson
that raised on purpose could end there for a learner. A block that raises nothing, or
another kind of error, is itself an error: the lesson would be showing something other
than what its text says.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def expect_error(*kinds: type[BaseException]):
    """Run the block; print ``Kind: message`` of the error it raises, one of ``kinds``
    (default: any ``Exception``). Raise ``AssertionError`` if the block raises nothing."""
    kinds = kinds or (Exception,)
    names = " or ".join(k.__name__ for k in kinds)
    try:
        yield
    except kinds as err:
        print(f"{type(err).__name__}: {err}")
        return
    raise AssertionError(f"expected {names}, but the block ran without raising it")
