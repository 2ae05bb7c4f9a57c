"""Fake-kernel registration across torch versions.

torch >= 2.4 has torch.library.register_fake; torch 2.2-2.3 has impl_abstract; torch 2.1 gets the
same function registered at the Meta dispatch key of a torch.library.Library. (Autograd is
registered in C++, csrc/autograd.cpp, the same way on every version.)
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
