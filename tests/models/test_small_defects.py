"""Inputs that would otherwise fail far from their cause: option values (non-finite budgets, strings
for switches), KERNELGRAFT_LM_HEAD_CHUNK, a pattern's extra_check that raises, patterns that can
never be served, and a named pipe in the kernel cache. Each is refused where it is given, in one
line that names it, or kept from ever stopping a forward."""

from __future__ import annotations

import copy
import os
import stat
import threading
import warnings

import pytest
import torch
from tiny import batch, tiny_model

import kernelgraft
from kernelgraft import Options, Scalar
from kernelgraft.kernels import cache
from kernelgraft.kernels.lm_head import kernel as lm_kernel
from kernelgraft.patterns import REGISTRY, Registry

INF, NAN = float("inf"), float("nan")


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ---- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [INF, -INF, NAN, -1.0, 0.0, 1e308], ids=str)
def test_a_budget_that_is_not_a_finite_positive_size_is_refused_where_it_is_given(value):
    with pytest.raises(ValueError, match="lm_head_memory") as e:
        Options(lm_head_memory=value)
    text = _one_line(e)
    assert "finite" in text and '"min"' in text and repr(value) in text
    with pytest.raises(ValueError, match="lm_head_memory must be a positive, finite"):
        kernelgraft.optimize(torch.nn.Linear(2, 2), lm_head_memory=value)


@pytest.mark.parametrize("value", [INF, NAN, -5.0, 1e308, True, "100"], ids=str)
def test_a_ddp_piece_that_is_not_a_finite_positive_size_is_refused(value):
    with pytest.raises(ValueError, match="ddp_piece_mb must be a positive, finite size") as e:
        Options(ddp_piece_mb=value)
    assert repr(value) in _one_line(e)


def test_a_whole_number_beyond_any_float_is_refused_as_a_size():
    with pytest.raises(ValueError, match="lm_head_memory must be a positive, finite"):
        Options(lm_head_memory=10**400)
    with pytest.raises(ValueError, match="ddp_piece_mb must be a positive, finite"):
        Options(ddp_piece_mb=10**400)


def test_finite_budgets_and_pieces_are_kept_as_given():
    assert Options(lm_head_memory=0.5).lm_head_memory == 0.5
    assert Options(lm_head_memory=4).lm_head_memory == 4
    assert Options(lm_head_memory="min").lm_head_memory == "min"
    assert Options(ddp_piece_mb=1e6).ddp_piece_mb == 1e6


def test_an_infinite_budget_is_refused_before_the_first_step():
    """optimize() refuses it (in the LM head's plan it is a NaN chunk, 'cannot convert float NaN to
    integer' at the first step), and leaves the model as it was."""
    stock = tiny_model("llama")
    m = copy.deepcopy(stock)
    with pytest.raises(ValueError, match="lm_head_memory"):
        kernelgraft.optimize(m, backend="eager", lm_head_memory=INF)
    assert not hasattr(m, "kernelgraft_report")
    b = batch()
    torch.testing.assert_close(m(**b).loss, stock(**b).loss, rtol=0, atol=0)


SWITCHES = ("keep_logits", "causal_attention", "fuse_projections")


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, None, 1.0])
def test_a_switch_takes_true_or_false_only(name, value):
    with pytest.raises(ValueError, match=f"{name} must be True or False") as e:
        Options(**{name: value})
    assert repr(value) in _one_line(e)


@pytest.mark.parametrize("value", ["no", "False", 0])
def test_optimize_refuses_a_string_for_causal_attention_instead_of_reading_it_as_true(value):
    with pytest.raises(ValueError, match="causal_attention must be True or False"):
        kernelgraft.optimize(torch.nn.Linear(2, 2), causal_attention=value)


@pytest.mark.parametrize("value", ["no", "True", 0, 1])
def test_optimize_refuses_a_dynamic_that_is_not_true_false_or_none(value):
    with pytest.raises(TypeError, match="dynamic must be True, False or None") as e:
        kernelgraft.optimize(torch.nn.Linear(2, 2), dynamic=value)
    assert repr(value) in _one_line(e)


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, "fused"])
def test_recompute_takes_true_false_or_separate_only(value):
    with pytest.raises(ValueError, match="recompute must be True, False or 'separate'") as e:
        Options(recompute=value)
    assert repr(value) in _one_line(e)


@pytest.mark.parametrize("value", [8.0, "8", True, INF, NAN, 0, -8])
def test_lm_head_chunk_takes_a_positive_whole_number_only(value):
    with pytest.raises(ValueError, match="lm_head_chunk must be a positive number of tokens") as e:
        Options(lm_head_chunk=value)
    assert repr(value) in _one_line(e)


@pytest.mark.parametrize(
    "name, value",
    [
        ("backend", "Eager"),
        ("backend", None),
        ("mode", "fast"),
        ("launch", True),
        ("inference", ["kernels"]),
        ("wrapper", "c++"),
        ("lm_head_accumulate", "bf16"),
    ],
)
def test_a_named_choice_takes_one_of_its_values_only(name, value):
    with pytest.raises(ValueError, match=f"{name} must be one of") as e:
        Options(**{name: value})
    assert repr(value) in _one_line(e)


# ---- KERNELGRAFT_LM_HEAD_CHUNK ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "1.5", "-3", "64 tokens", "inf"])
def test_a_bad_lm_head_chunk_variable_is_refused_when_options_are_made(monkeypatch, value):
    monkeypatch.setenv("KERNELGRAFT_LM_HEAD_CHUNK", value)
    with pytest.raises(ValueError, match="KERNELGRAFT_LM_HEAD_CHUNK") as e:
        Options()
    text = _one_line(e)
    assert repr(value) in text and "positive whole number" in text
    with pytest.raises(ValueError, match="KERNELGRAFT_LM_HEAD_CHUNK"):
        kernelgraft.optimize(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("value, chunk", [("", None), ("0", None), ("77", 77), (" 64 ", 64)])
def test_a_good_lm_head_chunk_variable_is_read_as_tokens(monkeypatch, value, chunk):
    from kernelgraft.options import lm_head_chunk_from_env

    monkeypatch.setenv("KERNELGRAFT_LM_HEAD_CHUNK", value)
    Options()  # accepted
    assert lm_head_chunk_from_env() == chunk


def test_the_lm_head_kernel_names_a_bad_chunk_variable_set_after_optimize(monkeypatch):
    monkeypatch.setenv("KERNELGRAFT_LM_HEAD_CHUNK", "many")
    chunk = lambda: lm_kernel.chunk_tokens(100, 64, 4)
    plan = lambda: lm_kernel.plan(100, 8, 64, 4, 0, "auto", 0.0)
    for read in (chunk, plan):
        with pytest.raises(ValueError, match="KERNELGRAFT_LM_HEAD_CHUNK") as e:
            read()
        assert "'many'" in _one_line(e)


# ---- a pattern's extra_check that raises --------------------------------------------------------------


def _checked_norm_registry(check) -> Registry:
    local = Registry()

    @kernelgraft.pattern("rms_norm_checked", spelling="llama_like", extra_check=check, registry=local)
    def rms_norm_checked(x, weight, eps: Scalar):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    return local


# the norm sites the model's graphs hold: per layer class, the layers' two and the final norm
@pytest.mark.parametrize("capture,norms", [("layers", 3), ("whole", 5)])
def test_an_extra_check_that_raises_is_a_fallback_of_its_sites_not_a_dead_forward(monkeypatch, capture, norms):
    monkeypatch.setattr(kernelgraft._warnings, "_WARNED", set())
    calls = []

    def broken(site):
        calls.append(site.pattern)
        raise RuntimeError("the check looked up a missing key")

    stock = tiny_model("llama")
    local = _checked_norm_registry(broken)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", patterns=local, capture=capture)
    b = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = mine(**b).loss
    torch.testing.assert_close(got, stock(**b).loss, rtol=0, atol=0)  # the stock code ran every norm
    rep = mine.kernelgraft_report
    assert calls and rep.counts() == {} and len(rep.fallbacks) == norms
    for site in rep.fallbacks:
        assert "rms_norm_checked" in site.reason and "llama_like" in site.reason
        assert "RuntimeError: the check looked up a missing key" in site.reason
    said = [str(w.message) for w in caught if "extra_check" in str(w.message)]
    assert len(said) == 1, said  # once, not once per site
    assert "rms_norm_checked" in said[0] and "llama_like" in said[0] and "missing key" in said[0]


def test_an_extra_check_that_returns_a_reason_still_refuses_and_one_that_returns_none_serves():
    refused = _checked_norm_registry(lambda site: "not this one").get("rms_norm_checked")
    served = _checked_norm_registry(lambda site: None).get("rms_norm_checked")
    site = kernelgraft.patterns.Site("rms_norm_checked", "llama_like", {"x": torch.empty(2, 8)}, {})
    assert refused.extra_check(site) == "not this one" and served.extra_check(site) is None


# ---- patterns that can never be served are refused at the decorator ------------------------------------


def _doubled(x):
    return x * 2


def _identity(x):
    return x


def _contiguous(x):
    return x.contiguous()


def _row_sum(x):
    return x.sum(-1, keepdim=True)


def _row_sum_dropped(x):
    return x.sum(-1)


def _to_double(x):
    return x.double() * 2


def _row_length(x):
    return x.shape[-1]


def _scalar_only(x, eps: Scalar):
    return eps * 2


def _unused_weight(x, weight):
    return x * 2


def _unused_first(x, weight):
    return weight * 2


def _unused_scalar(x, eps: Scalar):
    return x * 2


NEVER_SERVED = {
    "identity": (_identity, "computes nothing"),
    "contiguous": (_contiguous, "computes nothing"),
    "row sum": (_row_sum, "output does not vary per element"),
    "row sum, dim dropped": (_row_sum_dropped, "only row reductions"),
    "a cast to float64": (_to_double, "casts to torch.float64"),
    "the row's length": (_row_length, "last_dim has no element-wise kernel form"),
    "a number of its scalars": (_scalar_only, "does not read x"),
    "an unused weight": (_unused_weight, "does not read weight"),
    "an unused first argument": (_unused_first, "does not read x"),
    "an unused scalar": (_unused_scalar, "does not read eps"),
}


@pytest.mark.parametrize("case", list(NEVER_SERVED))
def test_a_pattern_no_site_could_be_served_by_is_refused_where_it_is_written(case):
    fn, why = NEVER_SERVED[case]
    local = Registry()
    with pytest.raises(TypeError, match="kernelgraft.pattern") as e:
        kernelgraft.pattern("never_served", registry=local)(fn)
    text = _one_line(e)
    assert why in text and fn.__name__ in text, text
    assert local.names() == []


def test_a_pattern_for_an_unknown_kernel_family_is_refused_where_it_is_written():
    # the same function with the family named well registers
    assert kernelgraft.pattern("served", registry=Registry())(_doubled).kernel == "row"
    with pytest.raises(TypeError, match="kernel='rows', which no kernel family serves") as e:
        kernelgraft.pattern("never_served", kernel="rows", registry=Registry())(_doubled)
    text = _one_line(e)
    assert all(repr(k) in text for k in ("row", "lm_head_ce", "lora")), text


def test_a_pattern_that_can_be_served_still_registers_and_serves():
    local = _checked_norm_registry(None)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", patterns=local)
    b = batch()
    mine(**b)
    assert mine.kernelgraft_report.counts() == {"rms_norm_checked": 5}
    assert [s.name for s in REGISTRY.spellings(["rms_norm"])][:1] == ["llama"]  # built-ins registered


# ---- a named pipe in the kernel cache ------------------------------------------------------------------


def test_a_named_pipe_in_place_of_a_kernel_file_is_replaced_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(tmp_path / "kg"))
    monkeypatch.setattr(kernelgraft._warnings, "_WARNED", set())
    source = "X = 11\n"
    _, path = cache.load_module("probe_fifo", source)
    path.unlink()
    os.mkfifo(path, 0o600)
    got: dict = {}

    def load():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got["module"], got["path"] = cache.load_module("probe_fifo", source, interpret=True)
        got["warned"] = [str(w.message) for w in caught]

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=60)
    if t.is_alive():  # blocked opening the pipe: let it read end-of-file, then fail
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(timeout=60)
        pytest.fail(f"load_module blocked on the named pipe {path}")
    assert got["path"] == path and stat.S_ISREG(os.stat(path).st_mode) and cache._intact(path)
    assert got["module"].X == 11
    assert len(got["warned"]) == 1, got["warned"]
    assert str(path) in got["warned"][0] and "not a regular file (a named pipe)" in got["warned"][0]


def test_a_kernel_file_that_is_a_link_to_a_named_pipe_is_replaced_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(tmp_path / "kg"))
    source = "X = 12\n"
    _, path = cache.load_module("probe_fifo_link", source)
    path.unlink()
    os.mkfifo(tmp_path / "pipe", 0o600)
    path.symlink_to(tmp_path / "pipe")
    done = threading.Event()

    def load():
        cache.load_module("probe_fifo_link", source)
        done.set()

    t = threading.Thread(target=load, daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.start()
        t.join(timeout=60)
    if t.is_alive():
        os.close(os.open(tmp_path / "pipe", os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=60)
        pytest.fail(f"load_module blocked on the link {path} to a named pipe")
    assert done.is_set() and not path.is_symlink() and cache._intact(path)
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)  # the pipe itself left alone
