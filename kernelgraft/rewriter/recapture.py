"""A model captured again: after its hooks changed, or where its own code read the logits after the
graph that withheld them.

Dynamo keeps each frame's compiled graphs per code object and backend; a new entry for the model
alone would leave the frames a graph break made (the model's code around its layers' calls) running
their old graphs, whose records the report has dropped. `recapture` makes a new entry, gives the
grafter a new identity for dynamo (`Again`), and makes the layers' entries anew, so every graph the
model runs is captured again and reported.

In a training call the fused LM head + loss withholds the logits (the graph returns an empty marker
in their place). Captured whole, a forward that also reads them is seen in the graph and the head is
not fused. Captured in pieces (per layer class, or at a graph break) the head's graph cannot see
code that runs after it: a wrapper computing a metric from the logits meets the marker. When the
first training call fails so, api's `_run` captures the model again with the logits made
(`again_with_logits`) and runs the call again from the same random generator states, and the report
names the line that read them.
"""

from __future__ import annotations

import os
import traceback

import torch

from .layers import capture_layers

# where the frames of torch and kernelgraft are: not the model's code
_OWN = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def rng_state(state=None):
    """The host's and the devices' random generator states (what dropout draws from); with `state`,
    those states set back."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if state is None:
        return torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    return state


def model_line(error: BaseException) -> str:
    """The line of the model's code (not torch's or kernelgraft's) where `error` was raised, as
    "`acc = logits.argmax(-1)` (train.py:12)"; "" where none is known. Dynamo's errors hold the
    frames it traced; other errors' tracebacks hold them."""
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    stacks = [list(getattr(e, "real_stack", None) or []) for e in chain]
    for frames in [*stacks, *(traceback.extract_tb(e.__traceback__) for e in chain)]:
        mine = [f for f in frames if f.line and not f.filename.startswith(_OWN)]
        if mine:
            f = mine[-1]
            return f"`{f.line.strip()}` ({os.path.basename(f.filename)}:{f.lineno})"
    return ""


class Again:
    """The grafter under another identity: dynamo keeps each frame's compiled graphs per backend, so
    the frames a graph break made (the model's code around its layers' calls) are captured again
    too, not only the model's entry. `compiler_fn`: where DDP's graph split finds the grafter."""

    def __init__(self, grafter):
        self.compiler_fn = grafter

    def __call__(self, gm, example_inputs):
        return self.compiler_fn(gm, example_inputs)


def again_with_logits(compiled, model, read: str) -> None:
    """The model captured again with its LM head's logits made (not withheld): the model's code read
    them (`read`: where) after the graph that withheld them. The report says so."""
    compiled.grafter.logits_read = read
    recapture(compiled, model)


def recapture(compiled, model) -> None:
    """Every graph of the model captured anew from its next call (api's _Compiled)."""
    grafter = compiled.grafter
    compiled.backend = Again(grafter)
    compiled.fn = compiled._entry()
    grafter.report.forget_captures()
    stack = compiled.layers
    if stack is not None:
        stack.remove()
        compiled.layers = None
        capture_layers(compiled, model, stack.rejected, offload=stack.offload)
