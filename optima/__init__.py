"""Optima: train LLM-based multi-agent systems to talk less and solve more (arXiv 2410.08115).

Importing the package does nothing else: no logging setup, no environment changes, no torch import.
"""

__version__ = "0.1.0"
