"""One module per op family; importing this package registers every rule.

The modules are found by listing the package (in name order), so a new op family is one new file.
"""
import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
