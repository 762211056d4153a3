"""Forwards that an instance holds wrapped (accelerate's mixed-precision wrappers, decorators).

``accelerator.prepare(model)`` with mixed precision replaces the instance's ``forward`` by
wrappers (autocast, outputs converted to fp32) around the class's forward function, linked
by ``__wrapped__`` as ``functools.wraps`` leaves them. An integration that swaps the
innermost function (flce's patched forward, flce's kernel behind TRL's fused head) must keep
those wrappers: ``wrapper_chain`` walks them and ``rewrapped`` builds copies of them around
another innermost function, leaving the originals (and any model sharing them) untouched.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

# Enough for any stack of wrappers seen in practice; a longer (or cyclic) chain is not followed.
MAX_WRAPPERS = 16


def wrapper_chain(forward, is_innermost: Callable[[Any], bool]) -> list:
    """``forward`` and what it wraps, outermost first, down to the first function for which
    ``is_innermost`` holds, following bound methods to their function and ``__wrapped__``
    links (the chain ends early, without such a function, where the links do)."""
    chain, current = [], forward
    while current is not None and len(chain) < MAX_WRAPPERS:
        current = getattr(current, "__func__", current)  # a bound method: its function
        chain.append(current)
        if is_innermost(current):
            break
        current = getattr(current, "__wrapped__", None)
    return chain


def _swapped(value, old, new):
    """``new`` where ``value`` is ``old`` (or a bound method of it), else ``value``."""
    if value is old:
        return new
    if isinstance(value, types.MethodType) and value.__func__ is old:
        return types.MethodType(new, value.__self__)
    if isinstance(value, functools.partial) and value.func is old:
        return functools.partial(new, *value.args, **value.keywords)
    return value


def _copy_pointing_at(wrapper, old, new):
    """A copy of ``wrapper`` whose references to ``old`` (closure cells, attributes) are to
    ``new``, or None where it holds none that can be seen."""
    if isinstance(wrapper, types.FunctionType):
        cells, replaced = [], False
        for cell in wrapper.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            swapped = _swapped(value, old, new)
            replaced |= swapped is not value
            cells.append(types.CellType(swapped) if swapped is not value else cell)
        function = types.FunctionType(
            wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(cells) or None
        )
        function.__kwdefaults__ = wrapper.__kwdefaults__
        function.__qualname__, function.__doc__, function.__module__ = (
            wrapper.__qualname__,
            wrapper.__doc__,
            wrapper.__module__,
        )
        for name, value in wrapper.__dict__.items():
            function.__dict__[name] = _swapped(value, old, new)
        return function if replaced else None  # a __wrapped__ link alone does not make it call `new`
    if callable(wrapper) and hasattr(wrapper, "__dict__"):  # a callable object, e.g. accelerate's ConvertOutputsToFp32
        try:  # not copy.copy: such wrappers may refuse to be pickled (accelerate's does)
            duplicate = object.__new__(type(wrapper))
        except TypeError:
            return None
        duplicate.__dict__.update(vars(wrapper))
        # Attributes functools.update_wrapper copied from `old` (its __dict__) may hold `old`
        # without the wrapper calling it, as the __wrapped__ link does.
        copied = {"__wrapped__", *getattr(old, "__dict__", {})}
        replaced = False
        for name, value in vars(wrapper).items():
            swapped = _swapped(value, old, new)
            if swapped is not value:
                setattr(duplicate, name, swapped)
                replaced = name not in copied or replaced
        return duplicate if replaced else None
    return None


def rewrapped(chain: list, innermost):
    """Copies of the wrappers ``chain[:-1]`` (outermost first, as ``wrapper_chain`` gives them)
    around ``innermost`` in place of ``chain[-1]``: the new outermost callable, or None where
    a wrapper holds what it wraps in a way that cannot be seen (then nothing is changed)."""
    inner_old, inner_new = chain[-1], innermost
    for wrapper in reversed(chain[:-1]):
        duplicate = _copy_pointing_at(wrapper, inner_old, inner_new)
        if duplicate is None:
            return None
        inner_old, inner_new = wrapper, duplicate
    return inner_new
