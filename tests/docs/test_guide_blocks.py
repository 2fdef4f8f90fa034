"""Every Python block of the user guide (docs/guide/*.md) runs on its own, in a fresh interpreter
(:mod:`tests.blocks`). ``make docs-test`` runs these; the README's blocks run in ``make test``."""

import pytest

from tests.blocks import GUIDE, blocks, run_block


def test_the_guide_has_python_blocks():
    assert len(blocks(GUIDE)) >= 5


@pytest.mark.parametrize("where,code", blocks(GUIDE), ids=[where for where, _ in blocks(GUIDE)])
def test_a_guide_block_runs_on_its_own(where, code, tmp_path):
    run_block(where, code, tmp_path)
