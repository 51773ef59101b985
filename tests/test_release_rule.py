"""The per-release collection rule (tests/conftest.py) and its list in docs/testing.md agree.

A test of something one Megatron-Core release lacks carries ``@pytest.mark.mcore_only(NAME, why=...)`` and is
deselected where ``megatron.fsdp.mcore_releases.NAME`` is false. docs/testing.md ("Two Megatron-Core
releases") lists every such test, the release it runs under and why; this keeps both in step, and checks
that every marker names a boolean of the compatibility module (a misspelt one would silently deselect).
"""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import MCORE_ONLY, release_has

ROOT = Path(__file__).resolve().parents[1]
_LISTED = re.compile(r"^\| `(tests/[^`]+::[A-Za-z0-9_]+)` \| [^|]*\(`(not )?([A-Z_]+)`\) \|", re.M)


def _marked_tests():
    """``{"tests/x.py::test_name": (feature, why)}`` from every ``mcore_only`` decorator under tests/."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "attr", None) == MCORE_ONLY:
                    feature = ast.literal_eval(deco.args[0])
                    why = next((ast.literal_eval(k.value) for k in deco.keywords if k.arg == "why"), "")
                    found[f"{path.relative_to(ROOT)}::{node.name}"] = (feature, why)
    return found


def test_every_release_only_test_is_listed_with_its_feature_and_a_reason():
    marked = _marked_tests()
    text = (ROOT / "docs" / "testing.md").read_text()
    block = text[text.index("<!-- release-only tests -->"):text.index("<!-- end release-only tests -->")]
    listed = {name: ((neg or "") + feature) for name, neg, feature in _LISTED.findall(block)}
    assert marked and listed == {name: feature for name, (feature, _) in marked.items()}, (listed, marked)
    assert all(why for _, why in marked.values()), marked
    for feature, _ in marked.values():
        release_has(feature)  # a boolean of the compatibility module (raises otherwise)


def test_the_rule_reads_the_compatibility_module():
    from megatron.fsdp import mcore_releases as compat

    assert release_has("HAS_LEGACY_GROUPED_MLP") is compat.HAS_LEGACY_GROUPED_MLP
    assert release_has("not HAS_LEGACY_GROUPED_MLP") is not compat.HAS_LEGACY_GROUPED_MLP
    with pytest.raises(pytest.UsageError, match="no boolean HAS_NO_SUCH_FEATURE"):
        release_has("HAS_NO_SUCH_FEATURE")
    with pytest.raises(pytest.UsageError, match="no boolean MCORE_VERSION_STRING"):
        release_has("MCORE_VERSION_STRING")
