"""Experiment configs: each file defines ``get_config()`` returning a frozen dataclass.

Files are loaded by path (``--config configs/mqar.py``); each docstring gives
the command, the runtime on a 2-core CPU and the result to expect.
"""
