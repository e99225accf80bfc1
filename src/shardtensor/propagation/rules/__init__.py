"""One module per op family; importing this package registers every rule."""
from . import (attention, embedding, factory, foreach, histogram, indexing, matrix, misc, nn, norm,  # noqa: F401
               pointwise, reduction, shaping, slicing, view)
