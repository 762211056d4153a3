"""Backends: each subpackage supplies a chunk CE kernel (``flce.backends.base``)."""
