"""A griffe extension for the API reference: `optimize`'s docstring as `help()` shows it, with every
option's documentation from its `Options` field (kernelgraft.options.with_options_help), read from
the source as mkdocstrings reads the rest."""

from __future__ import annotations

import griffe

from kernelgraft.options import with_options_help


class OptionsHelp(griffe.Extension):
    """Adds the "Other Parameters" section that `optimize.__doc__` gets at import."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs) -> None:
        if func.path == "kernelgraft.rewriter.api.optimize" and func.docstring is not None:
            func.docstring.value = with_options_help(func.docstring.value)
