"""One module per op family; importing this package registers every rule."""
from . import (attention, conv, embedding, factory, fft, foreach, histogram, indexing, linalg, matrix, misc, nn,  # noqa: F401
               norm, pointwise, reduction, shaping, slicing, view)
