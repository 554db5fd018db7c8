"""Rotary position embedding, as Hugging Face decoders spell it:

    q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

or with the pairs of adjacent columns rotated (GPT-J, GLM, Cohere...), cos and sin repeated per pair:

    q * cos + rotate_pairs(q) * sin,  rotate_pairs(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)

or that rotation written as two halves (DeepSeek-V3's multi-head latent attention and the models
built on it), the results de-interleaved and cos and sin half a row wide, one angle per pair:

    cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin),  x1, x2 = x[..., 0::2], x[..., 1::2]

or rotate-half written out over the two halves with half-width angles (GPT-OSS):

    cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin),  x1, x2 = chunk(x, 2, -1)

or as a complex product (Llama 4, DeepSeek-V2), which canonicalization reads as real ops with the
results in place: view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * f).flatten(-2), f the
float32 complex angles, cos and sin its parts (see the `complex` spelling)

cos and sin arrive unsqueezed on the head dim and already cast to the activation dtype (HF computes
them in float32 and casts), so the products round like the spelling. Either rotation is a permutation
within the row with a sign; the generator reads the input at the rotated column and derives the
adjoint, a rotation the other way (by -theta). One site per tensor: q and k are matched separately.
"""

import torch

from .registry import dtype_check, pattern


def _q_and_angles(rows, n, dtype, g, transposed=True):
    """q (1, S, 4 heads, n) in `dtype`, as HF's (1, heads, S, n) transposed view unless said
    otherwise, and one angle per pair (1, S, n / 2) in float32."""
    heads, n = 4, n + n % 2
    S = max(1, rows // heads)
    q = torch.randn(1, S, heads, n, generator=g).to(dtype)
    q = (q.transpose(1, 2) if transposed else q).requires_grad_()
    return q, torch.randn(1, S, n // 2, generator=g)


def _cos_sin(ang, dtype) -> dict:
    return {"cos": ang.cos().to(dtype).unsqueeze(1), "sin": ang.sin().to(dtype).unsqueeze(1)}


def _example(rows, n, dtype, g):
    """HF's layout: q (1, heads, S, n) as a transposed view, cos/sin (1, 1, S, n) with equal halves."""
    q, ang = _q_and_angles(rows, n, dtype, g)
    return {"x": q, **_cos_sin(ang.repeat(1, 1, 2), dtype)}


@pattern("rope", spelling="rotate_half", extra_check=dtype_check, example=_example)
def rope_rotate_half(x, cos, sin):
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rotated * sin


def _example_pairs(rows, n, dtype, g):
    """As _example, with each angle repeated for the two columns of its pair."""
    q, ang = _q_and_angles(rows, n, dtype, g)
    return {"x": q, **_cos_sin(ang.repeat_interleave(2, dim=-1), dtype)}


def _pairs_check(site) -> str | None:
    x = site.tensors.get("x")
    if x is not None and x.dim() and x.shape[-1] % 2:
        return f"the rotated dim has {x.shape[-1]} columns: pairs need an even count"
    return dtype_check(site)


@pattern("rope", spelling="interleaved", extra_check=_pairs_check, example=_example_pairs)
def rope_interleaved(x, cos, sin):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rotated * sin


@pattern("rope", spelling="rotate_half_back", extra_check=dtype_check, example=_example)
def rope_rotate_half_back(x, cos, sin):
    h = x.shape[-1] // 2
    rotated = torch.cat((x[..., h:], -x[..., :h]), dim=-1)
    return x * cos + rotated * sin


def _example_float32(rows, n, dtype, g):
    """As _example, cos and sin left in float32 (a spelling that computes in float32)."""
    ex = _example(rows, n, torch.float32, g)
    return {"x": ex["x"].detach().to(dtype).requires_grad_(), "cos": ex["cos"], "sin": ex["sin"]}


def _example_pairs_float32(rows, n, dtype, g):
    ex = _example_pairs(rows, n, torch.float32, g)
    return {"x": ex["x"].detach().to(dtype).requires_grad_(), "cos": ex["cos"], "sin": ex["sin"]}


@pattern("rope", spelling="rotate_half_float32", extra_check=dtype_check, example=_example_float32)
def rope_rotate_half_float32(x, cos, sin):
    xf = x.float()
    h = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@pattern("rope", spelling="interleaved_float32", extra_check=_pairs_check, example=_example_pairs_float32)
def rope_interleaved_float32(x, cos, sin):
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _example_halves(rows, n, dtype, g):
    """As _example, with cos and sin one angle per pair: half a row wide."""
    q, ang = _q_and_angles(rows, n, dtype, g)
    return {"x": q, **_cos_sin(ang, dtype)}


def _halves_check(site) -> str | None:
    for name in ("cos", "sin"):
        t = site.tensors.get(name)
        if t is not None and t.requires_grad:
            return f"{name} needs a gradient: its kernels read each angle for two columns and make none"
    return _pairs_check(site)


@pattern("rope", spelling="pairs_in_halves", extra_check=_halves_check, example=_example_halves)
def rope_pairs_in_halves(x, cos, sin):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _example_complex(rows, n, dtype, g):
    """Llama 4's layout: q (1, S, heads, n) as computed, cos and sin the parts of a float32 complex
    angle (1, S, 1, n / 2): views of its storage, every other float."""
    q, ang = _q_and_angles(rows, n, dtype, g, transposed=False)
    f = torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
    return {"x": q, "cos": torch.real(f), "sin": torch.imag(f)}


@pattern("rope", spelling="complex", extra_check=_halves_check, example=_example_complex)
def rope_complex(x, cos, sin):
    # view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * (cos + i sin)).flatten(-2):
    # canonicalization reads the complex product as these real ops (ir/complex.py)
    xf = x.float()
    a = xf[..., 0::2]
    b = xf[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


@pattern("rope", spelling="halves", extra_check=_halves_check, example=_example_halves)
def rope_halves(x, cos, sin):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
