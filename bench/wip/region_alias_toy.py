"""A nested compile region called with one tensor in two argument slots in one call and with two tensors in
another: Dynamo reuses the first call's traced body for the second and fails (here, both orders) or computes a
wrong result (a variant with three tensor slots) (torch 2.13 CPU, backend "eager", so not Inductor). Why decode_logits gives layer 0 two zero tensors, not one
twice.

    python bench/wip/region_alias_toy.py    # prints, per order of the calls, whether compiled equals eager
"""
import torch


@torch.compiler.nested_compile_region
def f(a, b, w):
    return torch.nn.functional.linear(a + 2 * b, w)


def aliased_first(x, y, w):
    return f(x, x, w) + f(x, y, w)


def distinct_first(x, y, w):
    return f(x, y, w) + f(x, x, w)


x, y, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
for g in (aliased_first, distinct_first):
    torch._dynamo.reset()
    try:
        ok = torch.allclose(g(x, y, w), torch.compile(g, backend="eager", fullgraph=True)(x, y, w))
    except Exception as e:  # noqa: BLE001  (the failure is what is printed)
        ok = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    print(torch.__version__, g.__name__, ok)
