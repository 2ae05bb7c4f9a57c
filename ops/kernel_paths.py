"""The CUDA kernel planner as seen from Python: the plan of a call, the overrides that force a
kernel path, and named settings of them.

The native library reads the ``FUSEDNORM_*`` overrides once into one struct (csrc/plan.h,
docs/design.md, "Kernel overrides"); after changing them in ``os.environ``, call
:func:`reload_overrides` (:func:`selected` does). Unset, each picks the planner's default.

The named paths are the ones the tests run every kernel on (TEST_PATHS: the one-pass kernels with
a small group in registers or in shared memory, the split passes, the team, the sweep and the
channels-last sweep kernels), the compute-sanitizer cases run, and tools/compare_paths.py times (PATHS, a superset).
One list here, so that a new knob reaches all three.
"""

import contextlib
import logging
import os

import torch

logger = logging.getLogger("fusednorm")

# Read by every build: they force the paths and variants the tests cover.
TEST_KNOBS = (
    "FUSEDNORM_ONE_PASS_MAX_BYTES",    # largest group of the one-pass kernels; set: forced (0: off)
    "FUSEDNORM_ONE_PASS_REGISTERS",    # 0: no register forward
    "FUSEDNORM_REGISTERS_LATE",        # 0: register forward without parameters holds its operands with x
    "FUSEDNORM_TEAM_FORWARD",          # 0: off, 1: every group
    "FUSEDNORM_TEAM_BACKWARD",         # 0: off, 1: every group
    "FUSEDNORM_SWEEP_FORWARD",         # 0: off, 1: every 16-bit group
    "FUSEDNORM_TEAM_PREFETCH",         # team kernels: k / 8 of the next chunk into L2 before a barrier wait (0: off)
    "FUSEDNORM_TEAM_REPLICAS",         # team kernels: copies of each CTA's partials (1-16)
    "FUSEDNORM_PARAM_GRAD_PARTS",      # CTAs (a cluster, sm_90) summing 32 channels' parameter gradients
    "FUSEDNORM_COLS_PIPELINE",         # channels-last shared-memory forward, 0: one group a CTA; 1: double-buffered with operands too
    "FUSEDNORM_COLS_SPAN",             # channels-last shared-memory forward: at most this many groups a CTA
    "FUSEDNORM_COLS_SWEEP",            # 0: off, 1: every channels-last group the channels-last sweep can take
)

# Read only by a build compiled with -DFUSEDNORM_TUNING_KNOBS (timing experiments).
TUNING_KNOBS = (
    "FUSEDNORM_ONE_PASS_MAX_CLUSTER",  # most CTAs of a one-pass cluster
    "FUSEDNORM_TEAM_CTA_KB",           # shared memory a team CTA holds
    "FUSEDNORM_TEAM_COUNT",            # teams of the team grid (at most those it holds)
    "FUSEDNORM_COLS_ACT_KERNEL",       # 0: channels-last activation-only split passes in the shared EPI kernels
    "FUSEDNORM_BACKWARD_THREADS",      # one-pass backward: threads a CTA (256 or 512)
    "FUSEDNORM_COLS_SWEEP_WAVES",      # channels-last sweep: moments tiles in this many waves of resident CTAs
    "FUSEDNORM_COLS_SWEEP_OUTPUT_WAVES",  # the same for its output tiles
)

KNOBS = TEST_KNOBS + TUNING_KNOBS

_ONE_PASS = {"FUSEDNORM_ONE_PASS_MAX_BYTES": str(1 << 20)}
_TEAM_OFF = {"FUSEDNORM_TEAM_FORWARD": "0", "FUSEDNORM_TEAM_BACKWARD": "0"}
_TEAM_ON = {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0", "FUSEDNORM_TEAM_FORWARD": "1", "FUSEDNORM_TEAM_BACKWARD": "1"}

TEST_PATHS = {
    "one_pass": _ONE_PASS,
    "one_pass_shared": {**_ONE_PASS, "FUSEDNORM_ONE_PASS_REGISTERS": "0"},
    # The split passes, with the parameter gradients summed by clusters of 8 CTAs (sm_90) even
    # where the default takes one.
    "split": {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0", **_TEAM_OFF, "FUSEDNORM_PARAM_GRAD_PARTS": "8"},
    "team": _TEAM_ON,
    "sweep": {"FUSEDNORM_SWEEP_FORWARD": "1"},
    "cols_sweep": {"FUSEDNORM_COLS_SWEEP": "1"},
}

PATHS = {
    "default": {},
    **TEST_PATHS,
    "noteam": _TEAM_OFF,  # the default without the team kernels
    "nosweep": {"FUSEDNORM_SWEEP_FORWARD": "0"},  # the default without the sweep kernels
    "nocolssweep": {"FUSEDNORM_COLS_SWEEP": "0"},  # the default without the channels-last sweep
    "team64": {**_TEAM_ON, "FUSEDNORM_TEAM_CTA_KB": "64"},  # tuning build only
    "team_prefetch": {**_TEAM_ON, "FUSEDNORM_TEAM_PREFETCH": "8"},  # the team kernels, every chunk prefetched whole
    "prefetch0": {"FUSEDNORM_TEAM_PREFETCH": "0"},  # the default without the team kernels' L2 prefetch
    "replicas1": {"FUSEDNORM_TEAM_REPLICAS": "1"},  # the default with one copy of the team partials
    "shared": {"FUSEDNORM_ONE_PASS_REGISTERS": "0"},  # the default without the register kernel
    "early": {"FUSEDNORM_REGISTERS_LATE": "0"},  # the default with the register kernel's operands loaded up front
    "cluster8": {"FUSEDNORM_ONE_PASS_MAX_CLUSTER": "8"},  # tuning build only
    "cluster4": {"FUSEDNORM_ONE_PASS_MAX_CLUSTER": "4"},  # tuning build only
    "param1": {"FUSEDNORM_PARAM_GRAD_PARTS": "1"},  # the default with one CTA per 32 channels' parameter gradients
    "colsact0": {"FUSEDNORM_COLS_ACT_KERNEL": "0"},  # tuning build only
    "colspipe0": {"FUSEDNORM_COLS_PIPELINE": "0"},
    "colspipe1": {"FUSEDNORM_COLS_PIPELINE": "1"},
    "colsspan1": {"FUSEDNORM_COLS_SPAN": "1"},  # one group a CTA
    "bwd256": {"FUSEDNORM_BACKWARD_THREADS": "256"},  # tuning build only: the one-pass backward in CTAs of 256 threads
}


def reload_overrides():
    """Makes the native library read the ``FUSEDNORM_*`` overrides again; returns them as it now
    holds them (a string: ``tuning_knobs=0|1`` and each override that is set)."""
    if not hasattr(torch.ops.fusednorm, "_reload_kernel_overrides"):
        return None  # a library from before the planner: it reads the knobs on every call
    return torch.ops.fusednorm._reload_kernel_overrides()


def tuning_knobs_compiled():
    """Whether this build reads TUNING_KNOBS (built with -DFUSEDNORM_TUNING_KNOBS)."""
    state = reload_overrides()
    return state is None or state.split()[0] == "tuning_knobs=1"


@contextlib.contextmanager
def selected(path):
    """Runs the block with the knobs of PATHS[path] set and every other knob unset, then restores
    the knobs as they were (the library reads them again on entry and on exit)."""
    saved = {name: os.environ.get(name) for name in KNOBS}
    try:
        for name in KNOBS:
            os.environ.pop(name, None)
        os.environ.update(PATHS[path])
        ignored = sorted(set(PATHS[path]) & set(TUNING_KNOBS))
        if ignored and not tuning_knobs_compiled():
            logger.warning("kernel path %r sets %s, which this build ignores (build with "
                           "-DFUSEDNORM_TUNING_KNOBS to read them)", path, ", ".join(ignored))
        reload_overrides()
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_overrides()


# An H200's properties: (SMs, compute capability major, minor, opt-in shared memory a CTA,
# shared memory an SM, L2 bytes, cooperative launch, clusters of 16 CTAs).
H200 = (132, 9, 0, 227 * 1024, 228 * 1024, 60 * 1024 * 1024, 1, 1)

_OPERANDS = ("scale", "shift", "residual", "multiplier")


def _device_properties(device):
    if isinstance(device, tuple):
        return device  # properties as H200 lists them
    if device is None:
        if not torch.cuda.is_available():
            return H200
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"plan: expected a CUDA device, got {device}")
    prop = torch.cuda.get_device_properties(device)
    # Fields older torch versions lack take an H200's value.
    return (
        prop.multi_processor_count,
        prop.major,
        prop.minor,
        getattr(prop, "shared_memory_per_block_optin", H200[3]),
        getattr(prop, "shared_memory_per_multiprocessor", H200[4]),
        getattr(prop, "L2_cache_size", H200[5]),
        1,
        int(prop.major >= 9),
    )


def plan(shape, num_groups, dtype, *, channels_last=False, activation=None, operands=False, backward=False,
         device=None, affine=True):
    """The kernel plan of ``fusednorm.group_norm`` (or, with ``backward=True``, its backward) on an
    input of ``shape`` and ``dtype`` with ``num_groups`` groups, a weight and a bias: a string such
    as ``"path=team teams=3 team_size=88 ..."`` (docs/design.md, "The planner").

    ``operands``: False for the affine parameters alone, True for the whole epilogue (scale, shift,
    residual and multiplier), or a sequence of those names (``"multiplier=residual"``: one tensor
    as both; ``"strided_rows"``: an input whose rows are contiguous but not back to back, the
    frames of an NCDHW video). ``device``: a CUDA device whose properties to plan for, or a tuple
    of properties as H200 lists them; None means the current CUDA device if any, else an H200. The
    residency of the kernels (CTAs an SM, clusters at once) is modeled from the properties, where a
    CUDA call asks the driver. ``affine=False``: without weight and bias. Needs no GPU.
    """
    if operands is True:
        names = list(_OPERANDS)
    elif operands is False or operands is None:
        names = []
    else:
        names = list(operands)
    act = "none" if activation is None else str(activation)
    return torch.ops.fusednorm._plan(list(shape), num_groups, dtype, channels_last, act,
                                     ",".join((["weight", "bias"] if affine else []) + names), backward,
                                     list(_device_properties(device)))
