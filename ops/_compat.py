"""Python-side op registration across torch versions.

torch >= 2.4 has torch.library.register_fake; torch 2.2-2.3 has impl_abstract; torch 2.1 gets the
same function registered at the Meta dispatch key of a torch.library.Library. Autograd is
registered at the Autograd key on every version (see register_autograd for why not through
torch.library.register_autograd).
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
    """Registers backward(ctx, *grads) and setup_context(ctx, inputs, output) as the op's autograd
    formula: an autograd.Function at the op's Autograd dispatch key, which is also what
    torch.library.register_autograd installs. Its wrapper, though, rebuilds the op's arguments for
    setup_context on every forward with torch._library.utils.fill_defaults, which reads
    schema.arguments (a fresh list of every argument) once per argument: 21 us per call for the
    11-argument fused op on a 2-core machine, most of a call's host time (a GN+SiLU forward with
    grad took 33 us through it and 13 us here). The kernel ops' schemas have no default values and
    no keyword-only arguments, so setup_context gets every argument as passed: nothing to fill in.
    """
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
        # As torch.library.register_autograd does: without grad mode or without an input that
        # requires grad there is no graph to record, and the Function (its ctx, setup_context and
        # saved tensors) would be pure host cost on every inference call.
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return _Function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    _library().impl(name, autograd_kernel, "Autograd")
