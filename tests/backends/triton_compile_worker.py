"""Compiles Triton kernels ahead of time for a GPU target, in a process of its own.

``python -m tests.backends.triton_compile_worker SPECS OUT``: SPECS is a JSON list of
``{"module", "kernel", "signature", "constants", "attrs", "num_warps"}``; OUT gets, per
kernel, the error (None when it compiled) and its PTX. A process without
``TRITON_INTERPRET``: under the interpreter ``@triton.jit`` makes interpreted functions,
which Triton's compiler cannot take.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def main(specs_path: str, out_path: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)  # Hopper
    results = {}
    for spec in json.load(open(specs_path)):
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        attrs = {tuple(index): value for index, value in spec["attrs"]}
        source = ASTSource(kernel, spec["signature"], constexprs=spec["constants"], attrs=attrs)
        try:
            compiled = triton.compile(source, target=target, options={"num_warps": spec["num_warps"]})
            results[spec["kernel"]] = {"error": None, "ptx": compiled.asm["ptx"]}
        except Exception as error:  # noqa: BLE001 - reported to the test, which names it
            results[spec["kernel"]] = {"error": f"{type(error).__name__}: {error}", "ptx": ""}
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
