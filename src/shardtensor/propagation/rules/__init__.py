"""One module per op family; importing this package registers every rule."""
from . import (attention, conv, embedding, factory, fft, foreach, histogram, indexing, linalg,  # noqa: F401
               matrix, misc, nn, norm, pointwise, reduction, scatter, shaping, slicing, view)
