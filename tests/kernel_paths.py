"""The CUDA kernel paths the environment knobs select, for tests that must run every path: one
pass (the forward holds a small group in registers, a larger one in shared memory), one pass with
the register kernel off, the split passes, and the team kernels (a group spread over the shared
memory of a team of CTAs, forward and backward)."""

PATHS = {
    "one_pass": {"FUSEDNORM_ONE_PASS_MAX_BYTES": str(1 << 20)},
    "one_pass_shared": {"FUSEDNORM_ONE_PASS_MAX_BYTES": str(1 << 20), "FUSEDNORM_ONE_PASS_REGISTERS": "0"},
    "split": {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0", "FUSEDNORM_TEAM_FORWARD": "0", "FUSEDNORM_TEAM_BACKWARD": "0"},
    "team": {"FUSEDNORM_ONE_PASS_MAX_BYTES": "0", "FUSEDNORM_TEAM_FORWARD": "1", "FUSEDNORM_TEAM_BACKWARD": "1"},
}
KNOBS = ("FUSEDNORM_ONE_PASS_MAX_BYTES", "FUSEDNORM_ONE_PASS_REGISTERS", "FUSEDNORM_TEAM_FORWARD",
         "FUSEDNORM_TEAM_BACKWARD")


def set_path(monkeypatch, path):
    """Selects `path` (a key of PATHS) for the rest of the test."""
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
