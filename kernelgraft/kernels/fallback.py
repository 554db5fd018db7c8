"""What every family does when its kernel fails at run time (compile error, out of resources, a
cache it may not load from): the failure is recorded once per (kernel, device type), a warning
names the sites it served and why, the report says they fell back, and the sites run the spelling's
own PyTorch code from then on: the same numbers as without kernelgraft. On the CPU every launch
holds launching.INTERPRETER while Triton's interpreter runs it, so a failure recorded there is the
kernel's own, never that of another thread's kernel running at the same time.
"""

from __future__ import annotations

import functools
import operator
import warnings
from contextlib import contextmanager

import torch

from .._warnings import warn_once

FAILED: dict = {}  # (kernel name, device type) -> why; see kernelgraft.kernels.failed_kernels()
# (spelling qualname, device type, dtype name) -> why: what a site's report entry reads
_FAILED_SITES: dict = {}
# the same key -> module paths of the sites replaced with that kernel, for the warning to name
_SITES: dict = {}


def site_key(qualname: str, device_type: str, dtype) -> tuple:
    """The key of the sites one kernel serves: spelling, device type, dtype of its first tensor."""
    return (qualname, device_type, str(dtype).replace("torch.", ""))


def register_site(key: tuple, module: str) -> None:
    """A site the rewriter replaced with the kernel of `key` (named if that kernel fails)."""
    mods = _SITES.setdefault(key, [])
    if module not in mods:
        mods.append(module)


def failure_of(key: tuple) -> str | None:
    """Why the kernel serving the sites of `key` failed in this process (None: it did not)."""
    return _FAILED_SITES.get(key) if _FAILED_SITES else None


def generation_failed(qualname: str, e: Exception) -> str:
    """The reason a site falls back when its kernel could not be generated or loaded at capture
    time, warned about once per reason (a refused cache directory has warned already)."""
    if getattr(e, "short", None):
        return e.short
    why = f"kernel generation failed: {type(e).__name__}: {e}"
    if not getattr(e, "warned", False):
        warn_once(("generation", why), f"kernelgraft: {qualname}: {why}. Its sites run their stock PyTorch code.")
    return why


def has_failed(name: str, device_type: str) -> bool:
    return bool(FAILED) and (name, device_type) in FAILED


def out_of_memory(e: BaseException) -> bool:
    """e says the machine or the device ran out of memory (CUDA's OutOfMemoryError, the CPU
    allocator's "can't allocate memory", numpy's MemoryError in the interpreter)."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def record_failure(name: str, dev: torch.device, e: Exception, consequence: str, spelling=None, dtype=None) -> None:
    """Record a generated kernel that failed to load, compile or launch (FAILED), and warn once,
    naming the sites it served (spelling and dtype: the sites' key, see site_key).
    Running out of memory is not a defect of the kernel: the error is raised again, as the stock
    code's own would be, and the kernel stays in use (recorded, one allocation that failed while
    another program held the memory would send the rest of the process to the stock code)."""
    if out_of_memory(e):
        raise e
    key = (name, dev.type)
    if key in FAILED:
        return
    why = f"{type(e).__name__}: {e}"[:1000]
    FAILED[key] = why
    where = ""
    if spelling is not None:
        skey = site_key(spelling.qualname, dev.type, dtype)
        _FAILED_SITES.setdefault(skey, why)
        mods = _SITES.get(skey, [])
        shown = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        where = f" Sites that fell back ({spelling.qualname}, {skey[2]}): {shown or 'those of this spelling'}."
    warnings.warn(  # once: the kernel is recorded, and not run again in this process
        f"kernelgraft: the generated kernel {name} failed on {dev.type} ({why}).{where} {consequence} "
        "model.kernelgraft_report lists them as fell back.",
        RuntimeWarning,
        stacklevel=5,
    )


# every autocast dispatch key (a key excluded in the thread's dispatch state: autocast off for that device)
AUTOCAST = functools.reduce(
    operator.or_,
    [torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, k)) for k in dir(torch._C.DispatchKey) if k.startswith("Autocast")],
)


@contextmanager
def as_in_eager():
    """Dispatch as plain eager code does. An op's implementation called from a compiled graph runs
    with the autograd and functorch dispatch keys excluded, and torch.func's transforms then fail
    ("Cannot access storage of TensorWrapper"): the stock code's gradients are computed with them
    restored (autocast stays off, as in any op's implementation)."""
    keep = torch._C._dispatch_tls_local_exclude_set() & AUTOCAST
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep):
        yield


def spelling_vjp(spelling, named: dict, diff: list[str], cotangent) -> tuple[torch.Tensor, dict]:
    """The spelling's output on the named arguments and its gradients for those named in `diff`,
    for the incoming gradient `cotangent(output)`. torch.func.vjp, not autograd: inside a custom
    op's implementation autograd does not record."""

    def f(*ts):
        call = dict(named, **dict(zip(diff, ts)))
        return spelling.fn(*(call[a] for a in spelling.arg_names))

    with as_in_eager():
        y, vjp = torch.func.vjp(f, *(named[n].detach() for n in diff))
        return y, dict(zip(diff, vjp(cotangent(y))))


def reference_gradients(spelling, grad: torch.Tensor, args: tuple, needs: list[bool]) -> list[torch.Tensor]:
    """The spelling's own gradients of its tensor arguments (an empty tensor where not needed)."""
    names = [n for n in spelling.arg_names if n in spelling.tensor_names]
    named = dict(zip(spelling.arg_names, args))
    diff = [n for n, need in zip(names, needs) if need and named[n].is_floating_point()]
    got = spelling_vjp(spelling, named, diff, lambda y: grad.to(y.dtype))[1] if diff else {}
    out = []
    for n, need in zip(names, needs):
        t = named[n]
        out.append(got.get(n, torch.zeros_like(t)) if need else t.new_empty(0))
    return out


def forget_failures() -> None:
    """Forget every recorded failure (FAILED and the sites'): the kernels are tried again. For a
    process that runs many independent models, one after another (a survey)."""
    FAILED.clear()
    _FAILED_SITES.clear()
