"""Triton's interpreter (TRITON_INTERPRET=1) for the suite's checks, without the work it repeats.

For each kernel launch the interpreter patches `triton.language` (every builtin of `tl`, `tl.tensor` and `tl.math`,
found by `inspect.getmembers`) and undoes it when the grid is done. It patches again on every call of a `@triton.jit`
helper inside the kernel, once per program of the grid, and never undoes those: the launch's patch is still in
place, the helper sees the same module objects, so each of these patches changes nothing. They were a fifth of the
checks' time (the int4 KV-cache case under cProfile: 11.9 s of 58 s in `_patch_builtin`, 7,348 patches for a few
dozen launches). `skip_repeated_patches()` makes a helper's call skip the patch where the launch running it has
already patched every language module the helper sees; launches, their patches and what the kernels compute are
unchanged. Where the interpreter's internals are not these (another Triton), it changes nothing.
"""
from __future__ import annotations

import inspect


def skip_repeated_patches() -> bool:
    """Install the skip in this process (after triton is imported); False where this Triton has other internals."""
    try:
        from triton.runtime import interpreter
        patch, Scope, tl = interpreter._patch_lang, interpreter._LangPatchScope, interpreter.tl
        Scope().restore()
    except (ImportError, AttributeError):
        return False
    if getattr(patch, "skips_repeats", False):
        return True
    patched: set[int] = set()  # the language modules the running launch has patched (ids)
    seen: dict[object, frozenset[int]] = {}  # a function's language modules, looked up once

    def languages(fn) -> frozenset[int]:
        if fn not in seen:  # as the interpreter looks for them
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_lang(fn):
        langs = languages(fn)
        if patched and langs <= patched:
            return Scope()  # already patched by the launch: nothing to do or to undo
        scope = patch(fn)
        if not patched:  # a launch: the patch lasts until it undoes it
            restore = scope.restore

            def undo() -> None:
                restore()
                patched.clear()

            scope.restore = undo
        patched.update(langs)
        return scope

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    return True
