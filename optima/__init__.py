"""Optima: train LLM-based multi-agent systems to talk less and solve more (arXiv 2410.08115).

Importing the package does nothing else: no logging setup, no environment changes, no torch import.
"""

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's `__getattr__`: each name of `exports` (name -> a module of the package, or a full module name)
    imported on first use, so importing the package imports none of its modules."""
    import importlib

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = exports[name] if exports[name].startswith("optima.") else f"{package}.{exports[name]}"
        return getattr(importlib.import_module(module), name)

    return __getattr__
