"""C++ and Metal sources of tfmetal_ext's custom TF ops.

Installed as package data (``tfmetal_ext._custom_ops``) so the op library can
be built on first use from a wheel; see ``tfmetal_ext/ops/_loader.py``.
"""
