"""Optimizer classes: thin orchestrators over :mod:`gefen.math`."""
