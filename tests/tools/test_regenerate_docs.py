"""The docs' generated blocks match the code (argument tables, listings, tool help): they cannot drift.

After adding an argument, a tool or a dataclass field, run ``python tools/regenerate_docs.py``.
"""

from tools import regenerate_docs


def test_generated_blocks_are_up_to_date(capsys):
    status = regenerate_docs.main(["--check"])
    assert status == 0, capsys.readouterr().out
    for block in regenerate_docs.BLOCKS:  # the sample outputs (regenerated with --run) are in place too
        assert regenerate_docs.current(block), f"{block.doc}: block {block.name} is missing or empty"
