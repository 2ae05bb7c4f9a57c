"""Python-side op registration across torch versions.

torch >= 2.4 has torch.library.register_fake and register_autograd; torch 2.2-2.3 has
impl_abstract; torch 2.1 has neither, and gets the same functions registered at the Meta and
Autograd dispatch keys of a torch.library.Library.
"""

import torch

_NAMESPACE = "fusednorm"
_impl_lib = None


def _library():
    global _impl_lib
    if _impl_lib is None:
        _impl_lib = torch.library.Library(_NAMESPACE, "IMPL")
    return _impl_lib


def register_fake(name):
    qualname = f"{_NAMESPACE}::{name}"

    def decorator(fn):
        if hasattr(torch.library, "register_fake"):
            torch.library.register_fake(qualname)(fn)
        elif hasattr(torch.library, "impl_abstract"):
            torch.library.impl_abstract(qualname)(fn)
        else:
            _library().impl(name, fn, "Meta")
        return fn

    return decorator


def register_autograd(name, backward, setup_context):
    if hasattr(torch.library, "register_autograd"):
        torch.library.register_autograd(f"{_NAMESPACE}::{name}", backward, setup_context=setup_context)
        return

    op = getattr(getattr(torch.ops, _NAMESPACE), name).default

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    def autograd_kernel(*args):
        return _Function.apply(*args)

    _library().impl(name, autograd_kernel, "Autograd")
