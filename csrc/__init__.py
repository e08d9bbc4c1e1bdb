"""CUDA C++ sources of moebalance (the top-level csrc/ directory), shipped as package data.

Read them with ``importlib.resources.files("moebalance._csrc")``.
"""
