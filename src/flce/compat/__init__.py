"""Drop-in shims with other libraries' names and signatures (``flce.compat.liger``)."""
