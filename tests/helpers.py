"""Helpers the test modules import (pytest puts tests/ on sys.path)."""

import numpy as np


def to_host(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)
