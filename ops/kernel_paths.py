"""The environment knobs that choose among the CUDA kernel paths, and named settings of them.

The C++ side reads the knobs on every call (docs/design.md, "Kernel-path knobs"); unset, each picks the
measured default. The named paths are the ones the tests run every kernel on (TEST_PATHS: the
one-pass kernels with a small group in registers or in shared memory, the split passes, the team
kernels), the compute-sanitizer cases run, and tools/compare_paths.py times (PATHS, a
superset). One list here, so that a new knob reaches all three."""

import contextlib
import os

KNOBS = (
    "FUSEDNORM_ONE_PASS_MAX_BYTES",    # largest group of the one-pass kernels; set: forced (0: off)
    "FUSEDNORM_ONE_PASS_REGISTERS",    # 0: no register forward
    "FUSEDNORM_REGISTERS_LATE",        # 0: register forward without parameters holds its operands with x
    "FUSEDNORM_ONE_PASS_MAX_CLUSTER",  # most CTAs of a one-pass cluster
    "FUSEDNORM_TEAM_FORWARD",          # 0: off, 1: every group
    "FUSEDNORM_TEAM_BACKWARD",         # 0: off, 1: every group
    "FUSEDNORM_TEAM_CTA_KB",           # shared memory a team CTA holds
    "FUSEDNORM_TEAM_PREFETCH",         # team kernels: k / 8 of the next chunk into L2 before a barrier wait (0: off)
    "FUSEDNORM_TEAM_REPLICAS",         # team backward: copies of each CTA's partials (1-16)
    "FUSEDNORM_PARAM_GRAD_PARTS",      # CTAs (a cluster, sm_90) summing 32 channels' parameter gradients
    "FUSEDNORM_COLS_ACT_KERNEL",       # 0: channels-last activation-only forward in the shared EPI kernel
    "FUSEDNORM_COLS_PIPELINE",         # channels-last shared-memory forward, 0: one group a CTA; 1: double-buffered with operands too
    "FUSEDNORM_COLS_SPAN",             # channels-last shared-memory forward: at most this many groups a CTA
    "FUSEDNORM_BACKWARD_THREADS",      # one-pass backward: threads a CTA (256 or 512)
)

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
}

PATHS = {
    "default": {},
    **TEST_PATHS,
    "noteam": _TEAM_OFF,  # the default without the team kernels
    "team64": {**_TEAM_ON, "FUSEDNORM_TEAM_CTA_KB": "64"},
    "team_prefetch": {**_TEAM_ON, "FUSEDNORM_TEAM_PREFETCH": "8"},  # the team kernels, every chunk prefetched whole
    "prefetch0": {"FUSEDNORM_TEAM_PREFETCH": "0"},  # the default without the team kernels' L2 prefetch
    "replicas1": {"FUSEDNORM_TEAM_REPLICAS": "1"},  # the default with one copy of the team partials
    "shared": {"FUSEDNORM_ONE_PASS_REGISTERS": "0"},  # the default without the register kernel
    "early": {"FUSEDNORM_REGISTERS_LATE": "0"},  # the default with the register kernel's operands loaded up front
    "cluster8": {"FUSEDNORM_ONE_PASS_MAX_CLUSTER": "8"},
    "cluster4": {"FUSEDNORM_ONE_PASS_MAX_CLUSTER": "4"},
    "param1": {"FUSEDNORM_PARAM_GRAD_PARTS": "1"},  # the default with one CTA per 32 channels' parameter gradients
    "colsact0": {"FUSEDNORM_COLS_ACT_KERNEL": "0"},
    "colspipe0": {"FUSEDNORM_COLS_PIPELINE": "0"},
    "colspipe1": {"FUSEDNORM_COLS_PIPELINE": "1"},
    "colsspan1": {"FUSEDNORM_COLS_SPAN": "1"},  # one group a CTA
    "bwd256": {"FUSEDNORM_BACKWARD_THREADS": "256"},  # the one-pass backward in CTAs of 256 threads
}


@contextlib.contextmanager
def selected(path):
    """Runs the block with the knobs of PATHS[path] set and every other knob unset, then restores
    the knobs as they were."""
    saved = {name: os.environ.get(name) for name in KNOBS}
    try:
        for name in KNOBS:
            os.environ.pop(name, None)
        os.environ.update(PATHS[path])
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
