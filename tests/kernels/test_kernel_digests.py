"""The generated Triton source of every built-in spelling, dtype mix and rounding is byte for byte
what tests/data/kernel_digests.json recorded: a change to the generator, the primitives table or the
printer that alters any kernel shows up here. After an intended change, record the new sources
with `python tests/kernels/kernel_digests.py --write` and say why in the commit."""

import json

import kernel_digests
import pytest


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_generated_sources_are_the_recorded_ones():
    stored = json.loads(kernel_digests.STORED.read_text())
    now = kernel_digests.digests()
    assert sorted(now) == sorted(stored), "spellings, dtypes or roundings differ from the recorded list"
    changed = sorted(k for k in now if now[k] != stored[k])
    assert not changed, f"{len(changed)} generated sources changed, e.g. {changed[:5]}"
