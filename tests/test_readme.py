"""Every Python block of README.md runs on its own, in a fresh interpreter (:mod:`tests.blocks`);
the user guide's blocks run in ``make docs-test`` (``tests/docs/test_guide_blocks.py``)."""

import pytest

from tests.blocks import GUIDE, README, SMALL, blocks, run_block


def test_the_readme_and_guide_have_python_blocks_and_every_small_size_is_used():
    found = blocks([README, *GUIDE])
    text = "".join(code for _, code in found)
    assert len(found) >= 7
    assert blocks([README]), "the README has no Python example"
    unused = [k for k in SMALL if k not in text]
    assert not unused, f"README and guide no longer contain {unused}: update SMALL in tests/blocks.py"


@pytest.mark.slow
@pytest.mark.parametrize("where,code", blocks([README]), ids=[where for where, _ in blocks([README])])
def test_a_readme_block_runs_on_its_own(where, code, tmp_path):
    run_block(where, code, tmp_path)
