"""A primitive is one entry of the table (kernelgraft/ir/primitives.py): with it, a pattern that uses
the op is canonicalized, matched in a model, and served by a generated kernel whose backward is
derived from the entry, as accurate as eager's."""

import sympy
import torch
import torch.nn.functional as F

import kernelgraft
from kernelgraft.gradcheck import check_spelling
from kernelgraft.ir import PRIMITIVES, Primitive, function
from kernelgraft.ir.sym import TRITON, Sigmoid
from kernelgraft.patterns import Registry


def test_a_new_primitive_is_one_table_entry():
    assert PRIMITIVES.of_target(F.softplus) is None  # not a built-in: this test adds it
    PRIMITIVES.add(
        Primitive(
            "softplus",
            (F.softplus,),
            # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): no overflow for large x; d/dx = sigmoid(x)
            forward=function(
                "Softplus",
                diff=Sigmoid,
                triton="(tl.maximum({0}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({0}))))",
                value=lambda x: sympy.log(1 + sympy.exp(x)),
            ),
        )
    )
    try:
        registry = Registry()

        @kernelgraft.pattern("softplus_gate", registry=registry)
        def softplus_gate(gate, up):
            return F.softplus(gate) * up

        sp = registry.get("softplus_gate")
        assert [n.op for n in sp.canonical().nodes if n.op != "input"] == ["softplus", "mul"]
        src = kernelgraft.kernels.rows.row_kernel(
            sp, {"gate": torch.float32, "up": torch.float32}, {"gate": "elem", "up": "elem"}
        )
        assert "tl.log(1.0 + tl.exp(-tl.abs(" in src.source  # the entry's Triton spelling
        assert str(src.backward.grads["v_gate"]) == "g*v_up*Sigmoid(v_gate)"  # derived from `diff`
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            gate = (torch.randn(37, 130, generator=g) * 4).to(dtype).requires_grad_()
            up = torch.randn(37, 130, generator=g).to(dtype).requires_grad_()
            verdicts = check_spelling(sp, (gate, up), compile_ref=False)
            assert all(v.ok for v in verdicts), [str(v) for v in verdicts]

        class Gate(torch.nn.Module):  # a model spelling it: matched and served
            def forward(self, gate, up):
                return F.softplus(gate) * up

        gate = torch.randn(4, 16, requires_grad=True)
        up = torch.randn(4, 16, requires_grad=True)
        assert kernelgraft.explain(Gate(), gate, up, patterns=[sp]).counts() == {"softplus_gate": 1}
        model = kernelgraft.optimize(Gate(), backend="eager", patterns=[sp])
        y = model(gate, up)
        dg, du = torch.autograd.grad(y.sum(), (gate, up))
        rg, ru = torch.autograd.grad(Gate()(gate, up).sum(), (gate, up))
        torch.testing.assert_close((dg, du), (rg, ru), rtol=2e-6, atol=1e-7)
        assert model.kernelgraft_report.counts() == {"softplus_gate": 1}
    finally:
        PRIMITIVES.remove("softplus")
        TRITON.pop("Softplus", None)
    assert PRIMITIVES.of_target(F.softplus) is None
